//! Storage faults: a SQLite database whose writes fail for a while (its `-wal` file made
//! immutable with `chattr +i`, or its disk, a 3 MB tmpfs, full), and whose file is deleted
//! under chatd. chatd must say so
//! while it lasts (`/readyz` 503, new runs 503) and heal by itself once the fault clears.
//! `chattr` and `mount` need root (and `chattr` a filesystem that has the flag): without
//! them these tests print why and pass without checking anything else.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::*;
use crate::runs::{resume, start, terminal_kinds};

/// The SQLite file behind a test app.
fn database_file(app: &TestApp) -> PathBuf {
    PathBuf::from(app.db_url.strip_prefix("sqlite://").expect("a SQLite app"))
}

/// A file made immutable until dropped (even if the test panics).
struct Immutable(PathBuf);

impl Immutable {
    /// `None` (with the reason printed) where `chattr` cannot do it here.
    fn make(path: &Path) -> Option<Self> {
        match Command::new("chattr").arg("+i").arg(path).output() {
            Ok(out) if out.status.success() => Some(Self(path.to_owned())),
            Ok(out) => {
                eprintln!("skipped: chattr +i failed here: {}", String::from_utf8_lossy(&out.stderr).trim());
                None
            }
            Err(e) => {
                eprintln!("skipped: no chattr here: {e}");
                None
            }
        }
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
    }
}

fn wal(app: &TestApp) -> PathBuf {
    let mut path = database_file(app).into_os_string();
    path.push("-wal");
    PathBuf::from(path)
}

/// Polls `/readyz` until it answers `want`, for up to 10 s.
async fn readiness_becomes(app: &TestApp, want: StatusCode) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _) = app.get("/readyz", "ann").await;
        if status == want {
            return;
        }
        assert!(Instant::now() < deadline, "/readyz still answers {status}, not {want}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn writes_that_fail_are_reported_and_heal_by_themselves() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let first = app.chat("ann", json!({"message": "before"})).await;
    assert_eq!(terminal_kinds(&first), ["complete"]);
    let Some(fault) = Immutable::make(&wal(&app)) else { return };

    // A new run cannot be started: refused whole, with the envelope, and nothing kept.
    let (status, body) = app.post("/api/chat/stream", "ann", json!({"message": "during"})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["code"], "SERVICE_UNAVAILABLE");
    let (status, body) = app.post("/api/conversations", "ann", json!({"title": "during"})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    readiness_becomes(&app, StatusCode::SERVICE_UNAVAILABLE).await;

    drop(fault);
    readiness_becomes(&app, StatusCode::OK).await;
    let after = app.chat("ann", json!({"message": "after"})).await;
    assert_eq!(terminal_kinds(&after), ["complete"], "{after:?}");
    let conversation = after[0].data["conversation_id"].as_str().unwrap();
    let (status, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(loaded["messages"][1]["content"], "Mock reply: after");
    let (_, list) = app.get("/api/conversations", "ann").await;
    let titles: Vec<&str> =
        list["conversations"].as_array().unwrap().iter().map(|c| c["title"].as_str().unwrap()).collect();
    assert_eq!(titles, ["after", "before"], "nothing of the refused requests was kept");
}

#[tokio::test]
async fn a_short_fault_at_a_runs_end_costs_a_wait_not_the_answer() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let _ = app.chat("ann", json!({"message": "warm"})).await;
    let mut live = start(&app, "ann", json!({"message": "[mock:words=30] [mock:delay=20] [mock:think=off]"})).await;
    live.until("text_delta").await;
    let Some(fault) = Immutable::make(&wal(&app)) else { return };
    // The run ends (~0.3 s) while writes fail; they work again 2 s later.
    tokio::time::sleep(Duration::from_secs(2)).await;
    drop(fault);
    let frames = live.rest().await;
    assert_eq!(terminal_kinds(&frames), ["complete"], "{:?}", frames.iter().map(Frame::kind).collect::<Vec<_>>());
    assert_eq!(frames.last().unwrap().kind(), "done");
    let trace_id = frames[0].data["trace_id"].as_str().unwrap();
    let (_, trace) = app.get(&format!("/api/trace/{trace_id}"), "ann").await;
    assert_eq!(trace["status"], "completed");
}

#[tokio::test]
async fn a_long_fault_ends_the_run_cleanly_and_its_trace_is_closed_once_writes_work() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let _ = app.chat("ann", json!({"message": "warm"})).await;
    let mut live = start(&app, "ann", json!({"message": "[mock:words=30] [mock:delay=20] [mock:think=off]"})).await;
    let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
    live.until("text_delta").await;
    let Some(fault) = Immutable::make(&wal(&app)) else { return };
    let frames = live.rest().await;
    let kinds: Vec<&str> = frames.iter().map(Frame::kind).collect();
    assert_eq!(terminal_kinds(&frames), ["error"], "{kinds:?}");
    let error = frames.iter().find(|f| f.kind() == "error").unwrap();
    assert_eq!(error.data["code"], "SERVICE_UNAVAILABLE");
    assert_eq!(kinds.last(), Some(&"done"));
    assert_eq!(kinds.iter().filter(|k| **k == "done").count(), 1);

    drop(fault);
    readiness_becomes(&app, StatusCode::OK).await;
    // The trace is closed as the client saw it, and its whole log was kept and written.
    let deadline = Instant::now() + Duration::from_secs(10);
    let trace = loop {
        let (_, trace) = app.get(&format!("/api/trace/{trace_id}"), "ann").await;
        if trace["status"] != "running" {
            break trace;
        }
        assert!(Instant::now() < deadline, "the trace stays running: {trace}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(trace["status"], "error");
    assert_eq!(trace["error"]["code"], "SERVICE_UNAVAILABLE");
    let replayed = resume(&app, "ann", &trace_id, None).await.rest().await;
    let replayed: Vec<&str> = replayed.iter().map(Frame::kind).collect();
    assert_eq!(replayed, kinds, "the replay is what the client saw");
    // And the next run is saved as usual.
    let next = app.chat("ann", json!({"message": "next"})).await;
    assert_eq!(terminal_kinds(&next), ["complete"]);
}

/// A 3 MB tmpfs mounted on a temporary folder until dropped.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    /// `None` (with the reason printed) where this process may not mount.
    fn mount() -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        match Command::new("mount").args(["-t", "tmpfs", "-o", "size=3m", "tmpfs"]).arg(dir.path()).output() {
            Ok(out) if out.status.success() => Some(Self { dir }),
            Ok(out) => {
                eprintln!("skipped: cannot mount a tmpfs here: {}", String::from_utf8_lossy(&out.stderr).trim());
                None
            }
            Err(e) => {
                eprintln!("skipped: no mount here: {e}");
                None
            }
        }
    }

    /// Fills what is left of the disk; returns the filler's path.
    fn fill(&self) -> PathBuf {
        use std::io::Write;
        let path = self.dir.path().join("filler");
        let mut file = std::fs::File::create(&path).unwrap();
        let block = vec![0u8; 4096];
        while file.write_all(&block).and_then(|()| file.sync_data()).is_ok() {}
        path
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

#[tokio::test]
async fn a_full_disk_is_reported_and_chatd_heals_once_there_is_room() {
    let Some(disk) = SmallDisk::mount() else { return };
    let url = format!("sqlite://{}/chatd.db", disk.dir.path().display());
    let app = TestApp::on(&url, "").await;
    let first = app.chat("ann", json!({"message": "before"})).await;
    assert_eq!(terminal_kinds(&first), ["complete"]);
    // The write-ahead log keeps its size after a checkpoint, and the migrations grew it: room
    // it holds would take writes without the disk. Truncated, it must grow on the full disk.
    let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&url).await.unwrap();
    sqlx::query("pragma wal_checkpoint(truncate)").execute(&mut conn).await.unwrap();
    drop(conn);
    let filler = disk.fill();

    // A long answer cannot be saved: refused at its start (503), or ended with one error.
    let response = app
        .client
        .post(app.url("/api/chat/stream"))
        .header("x-client-id", "ann")
        .json(&json!({"message": "full [mock:words=30000] [mock:think=off]"}))
        .send()
        .await
        .unwrap();
    let refused_trace = if response.status() == StatusCode::SERVICE_UNAVAILABLE {
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["code"], "SERVICE_UNAVAILABLE");
        None
    } else {
        let frames = read_frames(response).await;
        assert_eq!(terminal_kinds(&frames), ["error"], "the answer could not be saved");
        assert_eq!(frames.last().unwrap().kind(), "done");
        Some(frames[0].data["trace_id"].as_str().unwrap().to_owned())
    };

    std::fs::remove_file(filler).unwrap();
    readiness_becomes(&app, StatusCode::OK).await;
    let after = app.chat("ann", json!({"message": "after"})).await;
    assert_eq!(terminal_kinds(&after), ["complete"], "{after:?}");
    if let Some(trace_id) = refused_trace {
        let deadline = Instant::now() + Duration::from_secs(10);
        while app.get(&format!("/api/trace/{trace_id}"), "ann").await.1["status"] == "running" {
            assert!(Instant::now() < deadline, "the unsaved run's trace stays running");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test]
async fn a_database_file_deleted_under_chatd_is_reported_not_written_to() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let _ = app.chat("ann", json!({"message": "before"})).await;
    let folder = database_file(&app).parent().unwrap().to_owned();
    std::fs::remove_dir_all(&folder).unwrap();
    readiness_becomes(&app, StatusCode::SERVICE_UNAVAILABLE).await;
    let (status, body) = app.post("/api/chat/stream", "ann", json!({"message": "lost"})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["code"], "SERVICE_UNAVAILABLE");
}
