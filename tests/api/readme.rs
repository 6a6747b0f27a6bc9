//! The README's curl session, run as a user would: its `sh` blocks in order, in one bash,
//! against a fresh server (the README's address swapped for the test server's). Each step's
//! answer is checked in what the session prints.

use std::path::Path;
use std::process::Command;

use crate::helpers::*;

/// The `sh` blocks of the README's "A session with curl", in order.
fn session() -> String {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let start = readme.find("## A session with curl").expect("the README has a curl session");
    let section = &readme[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |end| end + 3)];
    let blocks: Vec<&str> = section.split("```sh\n").skip(1).map(|block| block.split("```").next().unwrap()).collect();
    assert!(blocks.len() >= 3, "the session's blocks");
    blocks.concat()
}

#[tokio::test]
async fn the_readmes_curl_session_runs_as_written() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let script = session();
    assert!(script.contains("CHATD=http://127.0.0.1:8080"), "the session says where chatd listens");
    let script =
        format!("set -euo pipefail\n{}", script.replace("CHATD=http://127.0.0.1:8080", &format!("CHATD={}", app.base)));
    let dir = tempfile::tempdir().unwrap();
    let output = tokio::task::spawn_blocking(move || {
        Command::new("bash").arg("-c").arg(script).current_dir(dir.path()).output().unwrap()
    })
    .await
    .unwrap();
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "the session stopped: {}\n{said}", String::from_utf8_lossy(&output.stderr));
    for (step, shown) in [
        ("the first answer", "Mock reply: Hello there"),
        ("the conversation's messages", r#""role": "assistant""#),
        ("the follow-up", "Mock reply: And now?"),
        ("the rename", r#""title": "Greetings""#),
        ("the rating", r#""rating": "up""#),
        ("the trace", r#""status": "completed""#),
        ("the cancel", r#""status": "cancelled""#),
        ("the resumed stream's end", r#""type":"cancelled""#),
        ("the delete", "\n204\n"),
    ] {
        assert!(said.contains(shown), "{step}: `{shown}` not in\n{said}");
    }
    let (_, list) = app.get("/api/conversations", "ann").await;
    assert_eq!(
        list["conversations"].as_array().unwrap().len(),
        1,
        "the story's conversation is left; the first is gone"
    );
}
