//! The Grafana dashboard in `docs/grafana/kvrouter.json` is well formed and every metric
//! its queries name is one the real binary exports (with the OpenAI front on), so a
//! renamed metric cannot leave a panel silently empty.

use std::collections::BTreeSet;

use kvrouter_tests::{free_port, http, repo_root, serve_binary};
use serde_json::Value;

#[test]
fn every_metric_the_dashboard_queries_is_exported() {
    let text = std::fs::read_to_string(repo_root().join("docs/grafana/kvrouter.json")).unwrap();
    let dash: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert!(dash["schemaVersion"].as_u64().is_some());
    let panels = dash["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut names = BTreeSet::new();
    for p in panels {
        assert!(
            ids.insert(p["id"].as_u64().expect("a panel id")),
            "ids are unique"
        );
        for k in ["x", "y", "w", "h"] {
            assert!(p["gridPos"][k].is_u64(), "{}: gridPos.{k}", p["title"]);
        }
        if p["type"] == "row" {
            continue;
        }
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{}: no query", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().expect("expr");
            assert!(t["refId"].is_string());
            let mut rest = expr;
            while let Some(i) = rest.find("kvrouter_") {
                let name: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[i + name.len()..];
                names.insert(name.strip_suffix("_bucket").unwrap_or(&name).to_owned());
            }
        }
    }
    assert!(names.len() >= 30, "{names:?}");

    let card = kvrouter_tests::openai::tiny_card();
    let openai = format!("127.0.0.1:{}", free_port());
    let model = format!("tiny={}", card.display());
    let served = serve_binary(
        env!("CARGO_BIN_EXE_kvrouter"),
        &[
            "--workers",
            "1",
            "--openai-listen",
            &openai,
            "--worker-url",
            "1=http://127.0.0.1:9",
            "--model",
            &model,
        ],
    );
    let api = served.api.clone();
    let (status, metrics) = http(&api, "GET", "/metrics", "", &[]);
    drop(served);
    assert_eq!(status, 200);
    let exported: BTreeSet<&str> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| !exported.contains(n.as_str()))
        .collect();
    assert!(missing.is_empty(), "queried but not exported: {missing:?}");
}
