//! Attachments in a real S3-compatible store: moto's server (PyPI, installed under target/s3
//! by scripts/s3-server.sh), started for the test, with chatd's `files.url = "s3://…"` and
//! `files.s3_endpoint` pointed at it. What the bucket holds is read through moto's own S3 API:
//! an upload becomes one content-addressed blob under the prefix and leaves no temporary
//! object nor unfinished multipart upload, a refused file leaves nothing, the same bytes are
//! kept once, the last deletion takes the blob with it, and the model is sent the bytes read
//! back from the bucket.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::files::{fixture, upload};
use crate::helpers::*;

const BUCKET: &str = "chatd-test";
const PREFIX: &str = "attachments";

/// The installed moto_server, or a failure that says how to install it.
fn moto_server() -> PathBuf {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/s3/venv");
    let program = venv.join("bin/moto_server");
    assert!(
        venv.join(".chatd-installed").exists() && program.exists(),
        "the S3 test server is not installed ({} is missing): run scripts/s3-server.sh",
        program.display()
    );
    program
}

/// A moto_server of the test's own; killed when dropped, even if the test panicked.
struct Moto {
    child: Child,
    endpoint: String,
    client: reqwest::Client,
    /// What moto prints (a line a request), shown when it does not start.
    log: tempfile::NamedTempFile,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Moto {
    /// Starts moto_server on a free port and waits until it answers. A port taken between
    /// `free_port` and moto binding it makes moto exit: then another port is tried.
    async fn start() -> Self {
        let program = moto_server();
        let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("client");
        let mut said = String::new();
        for _ in 0..3 {
            let port = free_port();
            let log = tempfile::NamedTempFile::new().expect("log file");
            let child = Command::new(&program)
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdin(Stdio::null())
                .stdout(log.reopen().expect("log file"))
                .stderr(log.reopen().expect("log file"))
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
            let moto = Self { child, endpoint: format!("http://127.0.0.1:{port}"), client: client.clone(), log };
            if moto.answers().await {
                return moto;
            }
            said = std::fs::read_to_string(moto.log.path()).unwrap_or_default();
        }
        panic!("moto_server did not start; it said:\n{said}");
    }

    /// Whether this moto answers HTTP, polling until it does, exits, or 30 s pass.
    async fn answers(&self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(30);
        let child_id = self.child.id();
        while Instant::now() < deadline {
            if !running(child_id) {
                return false;
            }
            let probe = self.client.get(self.url("/")).timeout(Duration::from_secs(1)).send().await;
            // moto signs its answers `server: amazon.com`: not another program on the port.
            if let Ok(response) = probe {
                return response.headers().get_all("server").iter().any(|v| v == "amazon.com");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.endpoint)
    }

    /// Creates the bucket (moto's server takes unsigned requests).
    async fn create_bucket(&self) {
        let response = self.client.put(self.url(&format!("/{BUCKET}"))).send().await.expect("create bucket");
        assert_eq!(response.status(), StatusCode::OK, "create bucket: {}", response.text().await.unwrap_or_default());
    }

    /// An unsigned GET on the bucket: its XML answer.
    async fn bucket(&self, query: &str) -> String {
        let response = self.client.get(self.url(&format!("/{BUCKET}?{query}"))).send().await.expect("bucket request");
        assert_eq!(response.status(), StatusCode::OK, "GET /{BUCKET}?{query}");
        response.text().await.expect("XML body")
    }

    /// Every object key under chatd's prefix (ListObjectsV2), sorted.
    async fn keys(&self) -> Vec<String> {
        let mut keys = elements(&self.bucket(&format!("list-type=2&prefix={PREFIX}/")).await, "Key");
        keys.sort();
        keys
    }

    /// Multipart uploads begun and neither completed nor aborted (ListMultipartUploads).
    async fn unfinished_uploads(&self) -> Vec<String> {
        let xml = self.bucket("uploads").await;
        elements(&xml, "Upload")
    }
}

/// Whether the process runs (a zombie, dead and waiting to be reaped, does not).
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()), Some('Z' | 'X')),
        Err(_) => false,
    }
}

/// The text of every `<tag>…</tag>` in an XML answer (S3's are flat enough for this).
fn elements(xml: &str, tag: &str) -> Vec<String> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    xml.split(&open).skip(1).filter_map(|rest| rest.split_once(&close)).map(|(text, _)| text.to_owned()).collect()
}

/// The credentials chatd's S3 client is built with: `Files::open` reads them through
/// `AmazonS3Builder::from_env`, once, when the app is built. moto takes any.
fn set_credentials() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for (key, value) in
            [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")]
        {
            if std::env::var(key).as_deref() != Ok(value) {
                // SAFETY: the environment is process-wide and other tests run on other
                // threads, but none of them reads these variables (only an `s3://` files.url
                // does, and only this module's test has one), std serializes its own reads
                // and writes of the environment, and it is written once, before this test's
                // app is built.
                unsafe { std::env::set_var(key, value) };
            }
        }
    });
}

#[tokio::test]
async fn attachments_live_in_a_real_s3_bucket() {
    let moto = Moto::start().await;
    moto.create_bucket().await;
    set_credentials();
    let config = format!(
        "[files]\nurl = \"s3://{BUCKET}/{PREFIX}\"\ns3_endpoint = \"{}\"\n[profiles.default]\nmodalities = [\"text\", \"image\"]\n",
        moto.endpoint
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;

    // An upload: sniffed as it streams to the bucket, then kept as its blob, and nothing else.
    let jpeg = fixture("photo.jpg");
    let (status, file) = upload(&app, "ann", "photo.jpg", jpeg.clone()).await;
    assert_eq!(status, StatusCode::CREATED, "{file}");
    assert_eq!(file["media_type"], "image/jpeg");
    assert_eq!(file["size"], jpeg.len());
    assert_eq!((file["width"].as_u64(), file["height"].as_u64()), (Some(640), Some(480)));
    let sha256 = file["sha256"].as_str().unwrap().to_owned();
    let blob = format!("{PREFIX}/blobs/{}/{sha256}", &sha256[..2]);
    assert_eq!(moto.keys().await, std::slice::from_ref(&blob), "one blob, no tmp/ object");
    assert_eq!(moto.unfinished_uploads().await, Vec::<String>::new());

    // Read back from the bucket: the same bytes.
    let id = file["id"].as_str().unwrap();
    let response =
        app.client.get(app.url(&format!("/api/files/{id}"))).header("x-client-id", "ann").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "image/jpeg");
    assert_eq!(response.bytes().await.unwrap().to_vec(), jpeg, "the same bytes back");

    // A refused file: its multipart upload is aborted, and no object is left.
    let (status, error) = upload(&app, "ann", "a.zip", b"PK\x03\x04\x14\x00\x00\x00\x08\x00rest".to_vec()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
    assert_eq!(moto.keys().await, std::slice::from_ref(&blob), "a refused file leaves no key");
    assert_eq!(moto.unfinished_uploads().await, Vec::<String>::new(), "nor an unfinished upload");

    // The same bytes again, another user's: one blob still.
    let (status, again) = upload(&app, "bob", "copy.jpg", jpeg.clone()).await;
    assert_eq!(status, StatusCode::CREATED, "{again}");
    assert_eq!(again["sha256"], sha256.as_str());
    assert_ne!(again["id"], file["id"]);
    assert_eq!(moto.keys().await, std::slice::from_ref(&blob), "content-addressed: one copy");

    // Ann's deletion leaves Bob's bytes; Bob's, the last, takes the blob.
    assert_eq!(app.call(Method::DELETE, &format!("/api/files/{id}"), "ann", None).await.0, StatusCode::NO_CONTENT);
    assert_eq!(moto.keys().await, std::slice::from_ref(&blob), "bob's file still has its bytes");
    let bobs = again["id"].as_str().unwrap();
    assert_eq!(app.call(Method::DELETE, &format!("/api/files/{bobs}"), "bob", None).await.0, StatusCode::NO_CONTENT);
    assert_eq!(moto.keys().await, Vec::<String>::new(), "the last file's bytes go with it");

    // Uploaded anew and attached to a message: the mock model reads the image's size from
    // the bytes chatd fetched from the bucket.
    let (status, photo) = upload(&app, "ann", "photo.jpg", jpeg).await;
    assert_eq!(status, StatusCode::CREATED, "{photo}");
    assert_eq!(moto.keys().await, [blob]);
    let frames = app.chat("ann", json!({"message": "What is this?", "attachments": [{"file_id": photo["id"]}]})).await;
    assert_eq!(frames.last().unwrap().kind(), "done", "{frames:?}");
    let text = joined(&frames, "text_delta");
    assert!(text.contains("[1 image 640×480 jpeg]"), "{text}");

    // A deletion racing an upload of the same bytes never takes the upload's blob (issue 34).
    crate::files::race_over_shared_bytes(&app, &app, 15).await;
}
