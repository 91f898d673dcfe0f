//! Replay-log conformance: the bundled sample log (and, on machines that have it, every log
//! of the shared corpus next to the checkout) replays through the reference index with
//! every answer as expected.

use kvrouter_core::index::ReferenceIndex;
use kvrouter_core::replay::ReplayChecker;
use kvrouter_io::log::LogReader;
use kvrouter_tests::{repo_root, shared_dir};

fn check(mut reader: LogReader) -> ReplayChecker {
    let mut index = ReferenceIndex::new();
    let mut check = ReplayChecker::new();
    while let Some((line, op)) = reader.next_op().unwrap() {
        check.step(&mut index, line, op);
    }
    check
}

#[test]
fn bundled_sample_passes() {
    let reader = LogReader::open(repo_root().join("bench/data/sample_w4.jsonl.zst")).unwrap();
    assert_eq!(reader.header.workers, 4);
    let requests = reader.header.requests;
    let check = check(reader);
    assert_eq!(check.matches, requests);
    assert!(check.events > 300);
    assert!(
        check.passed(),
        "{:?} {:?}",
        check.first_mismatches,
        check.first_rejections
    );
}

#[test]
fn shared_small_log_passes_when_present() {
    let Some(dir) = shared_dir() else {
        eprintln!("no ../shared on this machine: the bundled sample covers conformance");
        return;
    };
    let reader =
        LogReader::open(dir.join("workloads/conversation_w4_e4_c4096_n2000.jsonl.zst")).unwrap();
    let check = check(reader);
    assert_eq!(check.matches, 2000);
    assert!(
        check.passed(),
        "{:?} {:?}",
        check.first_mismatches,
        check.first_rejections
    );
}

#[test]
fn a_wrong_answer_is_reported() {
    let text = concat!(
        r#"{"op":"header","format":"kv-replay-log/1"}"#,
        "\n",
        r#"{"op":"store","worker":0,"event_id":0,"parent":null,"blocks":[[1,2]]}"#,
        "\n",
        r#"{"op":"match","blocks":[1],"expect":{"0":2}}"#,
        "\n",
    );
    let dir = std::env::temp_dir().join(format!("kvrouter-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("wrong.jsonl");
    std::fs::write(&path, text).unwrap();
    let check = check(LogReader::open(&path).unwrap());
    assert_eq!((check.matches, check.mismatches), (1, 1));
    assert_eq!(check.first_mismatches[0].line, 3);
    std::fs::remove_dir_all(dir).unwrap();
}
