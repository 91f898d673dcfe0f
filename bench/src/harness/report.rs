//! Reports: per policy the TTFT, inter-token latency and end-to-end latency statistics, the
//! throughput, the achieved prefix-hit ratio next to the trace's ideal, and each worker's
//! share of requests — as a table, as JSON (the CLI contract's keys), and as an SVG plot of
//! the TTFT CDF per policy.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::engine::EngineConfig;
use super::pacing::LatenessSummary;
use super::sim::Ideals;

/// Mean and percentiles of one latency, ms.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Latency {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// Mean and p99 of a latency, ms.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct MeanP99 {
    /// Mean.
    pub mean: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// What happened to one request (times in ms from the start of the replay).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestOutcome {
    /// Its line in the trace (0-based).
    pub request: usize,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Prompt blocks its engine found cached when it was admitted (device, host or pool),
    /// where the run can tell (`None` over NATS without the OpenAI front).
    pub cached_blocks: Option<u64>,
    /// Worker index it was routed to.
    pub worker: usize,
    /// Arrival.
    pub arrival: f64,
    /// When its engine gave it memory and began its prefill (in-process runs only).
    pub admitted: Option<f64>,
    /// First token.
    pub first: Option<f64>,
    /// Completion.
    pub done: Option<f64>,
    /// Mean gap between its tokens (none with a single token).
    pub itl: Option<f64>,
}

/// One policy's results. Field names are the JSON keys of the CLI contract.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    /// Policy name.
    #[serde(skip)]
    pub policy: String,
    /// Time to first token, ms.
    pub ttft_ms: Latency,
    /// Mean inter-token latency per request, ms.
    pub itl_ms: MeanP99,
    /// End-to-end latency, ms.
    pub e2e_ms: MeanP99,
    /// Completed requests per second.
    pub throughput_rps: f64,
    /// Prompt blocks served from the cache / prompt blocks.
    pub prefix_hit_ratio: f64,
    /// The trace's infinite-cache ideal.
    pub ideal_prefix_hit_ratio: f64,
    /// The trace's TTFT floor ([`Ideals::ttft_floor_mean`]): no policy's mean or p99 can
    /// be lower.
    pub ttft_floor_ms: MeanP99,
    /// What the cache capacity allows: one LRU cache of all workers' blocks, requests in
    /// arrival order.
    pub capacity_prefix_hit_ratio: f64,
    /// What the cache offered: the hit ratio had every request gone to the worker with
    /// the longest cached prefix (by the events-fed index) when it was routed. Tells a
    /// routing trade-off (hits below this) from hits that no choice could have had.
    /// In-process runs only (`null` in networked mode).
    pub offered_prefix_hit_ratio: Option<f64>,
    /// Prompt blocks onloaded from the engines' host memory / prompt blocks (`null`
    /// without a host tier).
    pub host_hit_ratio: Option<f64>,
    /// Prompt blocks onloaded from the fleet's shared pool / prompt blocks (`null` without
    /// a pool).
    pub pool_hit_ratio: Option<f64>,
    /// Requests per worker.
    pub requests_per_worker: Vec<u64>,
    /// Requests completed.
    pub completed: u64,
    /// The busiest and the idlest worker's utilisation over time (`null` in networked
    /// mode).
    pub utilisation: Option<Utilisation>,
    /// How late the engines' steps started against their timing model (networked mode;
    /// `null` in-process, where time is virtual).
    pub engine_lateness: Option<LatenessSummary>,
    /// How late the harness sent its requests against the trace's arrival times (networked
    /// mode; a request's TTFT counts from its arrival time, so it includes this).
    pub send_lateness: Option<LatenessSummary>,
    /// Sorted TTFTs, ms (for the plot).
    #[serde(skip)]
    pub ttfts: Vec<f64>,
    /// Every request's outcome, in trace order (for `--outcomes`).
    #[serde(skip)]
    pub outcomes: Vec<RequestOutcome>,
}

/// The busiest and the idlest worker (by requests served), over time: herding seen, not
/// inferred.
#[derive(Debug, Clone, Serialize)]
pub struct Utilisation {
    /// Width of each sample, s.
    pub bucket_s: f64,
    /// The worker that served the most requests.
    pub busiest: WorkerUtilisation,
    /// The worker that served the fewest.
    pub idlest: WorkerUtilisation,
    /// The most busy time any worker's engine spent running steps over the least, over
    /// the whole run (∞ when one never ran): balance in work, next to `max/min`'s balance
    /// in requests.
    pub busy_ratio: f64,
}

/// One worker's utilisation over time.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerUtilisation {
    /// Its index (0-based).
    pub worker: usize,
    /// Requests it served.
    pub requests: u64,
    /// Mean of `series`.
    pub mean: f64,
    /// Fraction of each bucket its engine spent running steps, from the first arrival.
    pub series: Vec<f64>,
}

impl WorkerUtilisation {
    /// `series` as one line of block characters (at most `width`, buckets averaged).
    pub fn sparkline(&self, width: usize) -> String {
        const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
        let n = self.series.len();
        if n == 0 {
            return String::new();
        }
        let per = n.div_ceil(width.max(1));
        self.series
            .chunks(per)
            .map(|c| {
                let m = c.iter().sum::<f64>() / c.len() as f64;
                BARS[((m.clamp(0.0, 1.0) * 7.0).round()) as usize]
            })
            .collect()
    }
}

/// Lines on the busiest and the idlest worker of every report.
pub fn utilisation_lines(reports: &[PolicyReport]) -> String {
    let mut s = String::new();
    for r in reports {
        let Some(u) = &r.utilisation else { continue };
        let _ = writeln!(
            s,
            "{:<14} busiest w{} ({} req, {:>3.0}% busy) {}   idlest w{} ({} req, {:>3.0}% busy) {}   busy time max/min {:.2}",
            r.policy,
            u.busiest.worker,
            u.busiest.requests,
            u.busiest.mean * 100.0,
            u.busiest.sparkline(30),
            u.idlest.worker,
            u.idlest.requests,
            u.idlest.mean * 100.0,
            u.idlest.sparkline(30),
            u.busy_ratio,
        );
    }
    s
}

/// Lines on how late the networked engines ran against their model, and the harness's
/// requests against the trace, for the reports that say (none in-process).
pub fn lateness_lines(reports: &[PolicyReport]) -> String {
    let mut s = String::new();
    for r in reports {
        for (l, what, unit) in [
            (
                &r.engine_lateness,
                "engine steps late against the model",
                "steps",
            ),
            (
                &r.send_lateness,
                "requests sent late against the trace",
                "requests",
            ),
        ] {
            let Some(l) = l else { continue };
            let _ = writeln!(
                s,
                "{:<14} {what}: p50 {:.2}ms, p99 {:.2}ms, max {:.1}ms, {:.2}% over 1 ms ({} {unit}){}",
                r.policy,
                l.p50_ms,
                l.p99_ms,
                l.max_ms,
                l.share_over_1ms * 100.0,
                l.count,
                if l.complete {
                    ""
                } else {
                    "; incomplete: an engine did not report on all its requests"
                },
            );
        }
    }
    s
}

pub(super) fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

pub(super) fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[(((v.len() - 1) as f64) * p).round() as usize]
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

impl PolicyReport {
    /// Builds a report from raw samples.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        policy: &str,
        ttft: Vec<f64>,
        itl: Vec<f64>,
        e2e: Vec<f64>,
        completed: u64,
        throughput_rps: f64,
        prefix_hit_ratio: f64,
        ideals: Ideals,
        requests_per_worker: Vec<u64>,
    ) -> Self {
        let (ttft, itl, e2e) = (sorted(ttft), sorted(itl), sorted(e2e));
        PolicyReport {
            policy: policy.to_owned(),
            ttft_ms: Latency {
                mean: mean(&ttft),
                p50: pct(&ttft, 0.5),
                p90: pct(&ttft, 0.9),
                p99: pct(&ttft, 0.99),
            },
            itl_ms: MeanP99 {
                mean: mean(&itl),
                p99: pct(&itl, 0.99),
            },
            e2e_ms: MeanP99 {
                mean: mean(&e2e),
                p99: pct(&e2e, 0.99),
            },
            throughput_rps,
            prefix_hit_ratio,
            ideal_prefix_hit_ratio: ideals.infinite,
            ttft_floor_ms: MeanP99 {
                mean: ideals.ttft_floor_mean,
                p99: ideals.ttft_floor_p99,
            },
            capacity_prefix_hit_ratio: ideals.capacity,
            offered_prefix_hit_ratio: None,
            host_hit_ratio: None,
            pool_hit_ratio: None,
            requests_per_worker,
            completed,
            utilisation: None,
            engine_lateness: None,
            send_lateness: None,
            ttfts: ttft,
            outcomes: Vec::new(),
        }
    }

    /// Builds a report from per-request outcomes. `span_s` is the time from the first
    /// arrival to the last completion; `hit`/`prompt` the engines' prompt-block counts.
    /// The report keeps the outcomes.
    pub fn from_outcomes(
        policy: &str,
        outcomes: Vec<RequestOutcome>,
        workers: usize,
        span_s: f64,
        (hit, prompt): (u64, u64),
        ideals: Ideals,
    ) -> Self {
        let mut per_worker = vec![0u64; workers];
        let (mut ttft, mut itl, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
        let mut completed = 0u64;
        for o in &outcomes {
            if let Some(n) = per_worker.get_mut(o.worker) {
                *n += 1;
            }
            ttft.extend(o.first.map(|f| f - o.arrival));
            itl.extend(o.itl);
            if let Some(d) = o.done {
                e2e.push(d - o.arrival);
                completed += 1;
            }
        }
        let mut report = PolicyReport::new(
            policy,
            ttft,
            itl,
            e2e,
            completed,
            completed as f64 / span_s.max(1e-9),
            if prompt == 0 {
                0.0
            } else {
                hit as f64 / prompt as f64
            },
            ideals,
            per_worker,
        );
        report.outcomes = outcomes;
        report
    }

    /// Sets the trace's ideals (computed beside the simulations).
    pub fn set_ideals(&mut self, ideals: Ideals) {
        self.ideal_prefix_hit_ratio = ideals.infinite;
        self.capacity_prefix_hit_ratio = ideals.capacity;
        self.ttft_floor_ms = MeanP99 {
            mean: ideals.ttft_floor_mean,
            p99: ideals.ttft_floor_p99,
        };
    }

    /// Busiest worker's share over the idlest's (∞ when one got nothing).
    pub fn share_ratio(&self) -> f64 {
        let max = self.requests_per_worker.iter().copied().max().unwrap_or(0) as f64;
        let min = self.requests_per_worker.iter().copied().min().unwrap_or(0) as f64;
        if min == 0.0 { f64::INFINITY } else { max / min }
    }
}

/// The table printed on stdout.
pub fn table(reports: &[PolicyReport]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<14} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>10} {:>9} {:>8} {:>9} {:>7} {:>7} {:>7} {:>7} {:>9}",
        "policy",
        "TTFT mean",
        "p50",
        "p90",
        "p99",
        "ITL mean",
        "ITL p99",
        "E2E mean",
        "req/s",
        "hit %",
        "offered %",
        "host %",
        "pool %",
        "cap %",
        "ideal %",
        "max/min"
    );
    for r in reports {
        let _ = writeln!(
            s,
            "{:<14} {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>7.1}ms {:>7.1}ms {:>8.0}ms {:>9.2} {:>8.1} {:>9} {:>7} {:>7} {:>7.1} {:>7.1} {:>9.2}",
            r.policy,
            r.ttft_ms.mean,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.itl_ms.mean,
            r.itl_ms.p99,
            r.e2e_ms.mean,
            r.throughput_rps,
            r.prefix_hit_ratio * 100.0,
            r.offered_prefix_hit_ratio
                .map_or_else(|| "-".to_owned(), |x| format!("{:.1}", x * 100.0)),
            r.host_hit_ratio
                .map_or_else(|| "-".to_owned(), |x| format!("{:.1}", x * 100.0)),
            r.pool_hit_ratio
                .map_or_else(|| "-".to_owned(), |x| format!("{:.1}", x * 100.0)),
            r.capacity_prefix_hit_ratio * 100.0,
            r.ideal_prefix_hit_ratio * 100.0,
            r.share_ratio(),
        );
    }
    if let Some(r) = reports.first() {
        let _ = writeln!(
            s,
            "TTFT floor (each request alone on an idle engine, every block it could ever hit cached): mean {:.0}ms, p99 {:.0}ms",
            r.ttft_floor_ms.mean, r.ttft_floor_ms.p99
        );
    }
    s
}

/// Every policy at every load side by side: mean and p99 TTFT, hits, max/min share.
/// `runs[i]` are the reports at `speeds[i]`, policies in the same order in each.
pub fn sweep_table(speeds: &[f64], runs: &[Vec<PolicyReport>]) -> String {
    let mut s = String::new();
    let _ = write!(s, "{:<14}", "policy");
    for sp in speeds {
        let _ = write!(s, " | {:^38}", format!("speed {sp}"));
    }
    let _ = writeln!(s);
    let _ = write!(s, "{:<14}", "");
    for _ in speeds {
        let _ = write!(
            s,
            " | {:>10} {:>10} {:>7} {:>7}",
            "mean", "p99", "hit %", "max/min"
        );
    }
    let _ = writeln!(s);
    let Some(first) = runs.first() else { return s };
    for (k, r0) in first.iter().enumerate() {
        let _ = write!(s, "{:<14}", r0.policy);
        for run in runs {
            let Some(r) = run.get(k) else { continue };
            let _ = write!(
                s,
                " | {:>9.2}s {:>9.2}s {:>7.1} {:>7.2}",
                r.ttft_ms.mean / 1e3,
                r.ttft_ms.p99 / 1e3,
                r.prefix_hit_ratio * 100.0,
                r.share_ratio()
            );
        }
        let _ = writeln!(s);
    }
    s
}

/// Writes `{speed: {policy: report}}` as JSON (speeds as written on the command line).
pub fn write_sweep_json(
    path: &Path,
    speeds: &[f64],
    runs: &[Vec<PolicyReport>],
) -> anyhow::Result<()> {
    let map: BTreeMap<String, BTreeMap<&str, &PolicyReport>> = speeds
        .iter()
        .zip(runs)
        .map(|(sp, run)| {
            (
                sp.to_string(),
                run.iter().map(|r| (r.policy.as_str(), r)).collect(),
            )
        })
        .collect();
    std::fs::write(path, serde_json::to_vec_pretty(&map)?)?;
    Ok(())
}

/// Draws a chart's legend at `at`, boxed on a light background.
fn legend<'a, DB, CT>(
    chart: &mut plotters::prelude::ChartContext<'a, DB, CT>,
    at: plotters::prelude::SeriesLabelPosition,
) -> Result<(), plotters::prelude::DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: plotters::prelude::DrawingBackend + 'a,
    CT: plotters::coord::CoordTranslate,
{
    use plotters::prelude::*;
    chart
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
}

/// Writes mean and p99 TTFT against load (log scale), one line per policy, as an SVG of
/// two panels.
pub fn write_sweep_svg(
    path: &Path,
    speeds: &[f64],
    runs: &[Vec<PolicyReport>],
    title: &str,
) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("plot {}: {e}", path.display());
    let root = SVGBackend::new(path, (960, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 18))
        .map_err(|e| err(&e))?;
    let panels = root.split_evenly((2, 1));
    let all = || runs.iter().flatten();
    let lo_speed = speeds.iter().copied().fold(f64::INFINITY, f64::min);
    let hi_speed = speeds
        .iter()
        .copied()
        .fold(0.0, f64::max)
        .max(lo_speed * 1.01);
    type Pick = fn(&PolicyReport) -> f64;
    let picks: [(&str, Pick); 2] = [
        ("mean TTFT (s, log scale)", |r| r.ttft_ms.mean / 1e3),
        ("p99 TTFT (s, log scale)", |r| r.ttft_ms.p99 / 1e3),
    ];
    for (panel, (label, pick)) in panels.iter().zip(picks) {
        let lo = all()
            .map(pick)
            .filter(|v| *v > 0.0)
            .fold(f64::INFINITY, f64::min);
        let lo = if lo.is_finite() {
            10f64.powf(lo.log10().floor())
        } else {
            0.01
        };
        let hi = 10f64
            .powf(all().map(pick).fold(lo, f64::max).log10().ceil())
            .max(lo * 10.0);
        let mut chart = ChartBuilder::on(panel)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(lo_speed..hi_speed, (lo..hi).log_scale())
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("load (--speed: arrival-time scale)")
            .y_desc(label)
            .draw()
            .map_err(|e| err(&e))?;
        let Some(first) = runs.first() else { break };
        for (k, r0) in first.iter().enumerate() {
            let color = Palette99::pick(k).to_rgba();
            let points: Vec<(f64, f64)> = speeds
                .iter()
                .zip(runs)
                .filter_map(|(&sp, run)| run.get(k).map(|r| (sp, pick(r).max(lo))))
                .collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(r0.policy.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                });
            chart
                .draw_series(
                    points
                        .into_iter()
                        .map(|p| Circle::new(p, 3, color.filled())),
                )
                .map_err(|e| err(&e))?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Writes `{policy: report}` as JSON.
pub fn write_json(path: &Path, reports: &[PolicyReport]) -> anyhow::Result<()> {
    let map: BTreeMap<&str, &PolicyReport> =
        reports.iter().map(|r| (r.policy.as_str(), r)).collect();
    std::fs::write(path, serde_json::to_vec_pretty(&map)?)?;
    Ok(())
}

/// Writes every request's outcome of every run as CSV, one line per request and policy:
/// `speed,policy,request,worker,arrival_ms,admitted_ms,first_ms,done_ms,input_tokens,cached_blocks,alone_ms`
/// (times in ms on the replay's clock; an empty field where the run does not know).
/// `alone_ms` is what the request's uncached tokens take alone on an idle `engine`
/// ([`EngineConfig::ttft_floor_ms`]).
pub fn write_outcomes_csv(
    path: &Path,
    speeds: &[f64],
    runs: &[Vec<PolicyReport>],
    engine: &EngineConfig,
) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(
        w,
        "speed,policy,request,worker,arrival_ms,admitted_ms,first_ms,done_ms,input_tokens,\
         cached_blocks,alone_ms"
    )?;
    let opt = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{v:.3}"));
    for (speed, reports) in speeds.iter().zip(runs) {
        for r in reports {
            for o in &r.outcomes {
                writeln!(
                    w,
                    "{speed},{},{},{},{:.3},{},{},{},{},{},{}",
                    r.policy,
                    o.request,
                    o.worker,
                    o.arrival,
                    opt(o.admitted),
                    opt(o.first),
                    opt(o.done),
                    o.input_tokens,
                    o.cached_blocks.map_or_else(String::new, |c| c.to_string()),
                    opt(o.cached_blocks.map(|c| {
                        let cached = c.saturating_mul(u64::from(engine.block_size));
                        let uncached = u64::from(o.input_tokens).saturating_sub(cached);
                        engine.ttft_floor_ms(uncached as u32)
                    })),
                )?;
            }
        }
    }
    w.flush()?;
    Ok(())
}

/// Writes the TTFT CDF of every policy as an SVG (log-scaled time axis), with plotters.
pub fn write_svg(path: &Path, reports: &[PolicyReport], title: &str) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let positive = || {
        reports
            .iter()
            .flat_map(|r| r.ttfts.iter().copied())
            .filter(|v| *v > 0.0)
    };
    let lo = positive().fold(f64::INFINITY, f64::min);
    let lo = if lo.is_finite() {
        10f64.powf(lo.log10().floor())
    } else {
        1.0
    };
    let hi = 10f64
        .powf(positive().fold(lo, f64::max).log10().ceil())
        .max(lo * 10.0);
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("plot {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1f64)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("time to first token (ms, log scale)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, r) in reports.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let n = r.ttfts.len().max(1) as f64;
        let step = (r.ttfts.len() / 1000).max(1);
        let points = r
            .ttfts
            .iter()
            .enumerate()
            .filter(|(k, _)| k % step == 0 || *k + 1 == r.ttfts.len())
            .map(|(k, v)| (v.max(lo), (k + 1) as f64 / n));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(format!(
                "{} (mean {:.2} s)",
                r.policy,
                r.ttft_ms.mean / 1000.0
            ))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight).map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
