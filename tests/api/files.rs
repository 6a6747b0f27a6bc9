//! Attachments (CONTRACT.md §14) over real HTTP: uploads (multipart, streamed, sniffed,
//! deduplicated, refused early when too large), files in messages (by id and as `data:`
//! URLs), what the mock model was sent of them, the profile's modalities, and what a
//! refusal or a deletion leaves behind: nothing.

use std::path::Path;

use base64::Engine;
use reqwest::StatusCode;
use reqwest::multipart::{Form, Part};
use serde_json::{Value, json};

use crate::helpers::*;

pub const TAKES_FILES: &str = r#"
[profiles.default]
modalities = ["text", "image", "pdf"]
[profiles.other]
modalities = ["text"]
"#;

pub fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/files").join(name)).unwrap()
}

pub fn data_url(media_type: &str, bytes: &[u8]) -> String {
    format!("data:{media_type};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// Uploads `bytes` as `name` for `user`; the status and the JSON answer.
pub async fn upload(app: &TestApp, user: &str, name: &str, bytes: Vec<u8>) -> (StatusCode, Value) {
    let form = Form::new().part("file", Part::bytes(bytes).file_name(name.to_owned()));
    let response =
        app.client.post(app.url("/api/files")).header("x-client-id", user).multipart(form).send().await.unwrap();
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Every file under the app's file storage (blobs and anything temporary).
pub fn stored_files(app: &TestApp) -> Vec<std::path::PathBuf> {
    fn walk(dir: &Path, found: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.path().is_dir() {
                walk(&entry.path(), found);
            } else {
                found.push(entry.path());
            }
        }
    }
    let mut found = Vec::new();
    walk(&app.files_dir, &mut found);
    found
}

both_backends! {
    async fn an_upload_is_sniffed_kept_once_read_back_and_deleted(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let jpeg = fixture("photo.jpg");
        // The client's name says PNG-ish nothing; the bytes say JPEG.
        let (status, file) = upload(&app, "ann", "holiday photo.jpg", jpeg.clone()).await;
        assert_eq!(status, StatusCode::CREATED, "{file}");
        assert_eq!(file["media_type"], "image/jpeg");
        assert_eq!(file["size"], jpeg.len());
        assert_eq!((file["width"].as_u64(), file["height"].as_u64()), (Some(640), Some(480)));
        assert_eq!(file["sha256"].as_str().unwrap().len(), 64);
        assert_eq!(file["name"], "holiday photo.jpg");
        let id = file["id"].as_str().unwrap();

        let response = app.client.get(app.url(&format!("/api/files/{id}"))).header("x-client-id", "ann").send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["content-type"], "image/jpeg");
        assert_eq!(response.headers()["x-content-type-options"], "nosniff");
        assert_eq!(response.bytes().await.unwrap().to_vec(), jpeg, "the same bytes back");
        // Another user gets 404, never the bytes.
        let (status, error) = app.get(&format!("/api/files/{id}"), "bob").await;
        assert_eq!((status, error["code"].as_str()), (StatusCode::NOT_FOUND, Some("NOT_FOUND")));

        // The same bytes again (another user's) are kept once.
        let (status, again) = upload(&app, "bob", "copy.jpg", jpeg.clone()).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(again["sha256"], file["sha256"]);
        assert_ne!(again["id"], file["id"]);
        assert_eq!(stored_files(&app).len(), 1, "content-addressed: one copy");

        // Bob cannot delete Ann's file; Ann's deletion leaves Bob's bytes.
        assert_eq!(app.call(reqwest::Method::DELETE, &format!("/api/files/{id}"), "bob", None).await.0, StatusCode::NOT_FOUND);
        assert_eq!(app.call(reqwest::Method::DELETE, &format!("/api/files/{id}"), "ann", None).await.0, StatusCode::NO_CONTENT);
        assert_eq!(app.get(&format!("/api/files/{id}"), "ann").await.0, StatusCode::NOT_FOUND);
        assert_eq!(stored_files(&app).len(), 1, "bob's file still has its bytes");
        let bobs = again["id"].as_str().unwrap();
        assert_eq!(app.call(reqwest::Method::DELETE, &format!("/api/files/{bobs}"), "bob", None).await.0, StatusCode::NO_CONTENT);
        assert!(stored_files(&app).is_empty(), "the last file's bytes go with it");
    }

    async fn every_kind_chatd_takes_is_told_by_its_bytes(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        for (name, bytes, media_type) in [
            ("small.png", fixture("small.png"), "image/png"),
            ("tiny.gif", fixture("tiny.gif"), "image/gif"),
            ("tiny.webp", fixture("tiny.webp"), "image/webp"),
            ("note.pdf", fixture("note.pdf"), "application/pdf"),
            ("cities.csv", fixture("cities.csv"), "text/csv"),
            ("notes.md", "# Notes\n\nÉté ✓".as_bytes().to_vec(), "text/markdown"),
            ("data.json", b"{\"a\": [1, 2]}".to_vec(), "application/json"),
            ("plain", b"no extension at all".to_vec(), "text/plain"),
        ] {
            let (status, file) = upload(&app, "ann", name, bytes).await;
            assert_eq!(status, StatusCode::CREATED, "{name}: {file}");
            assert_eq!(file["media_type"], media_type, "{name}");
        }
    }

    async fn bad_files_get_a_clear_error_and_leave_nothing(backend: Backend) {
        let app = TestApp::spawn(backend, "[files]\nmax_bytes = 1048576").await;
        let png = fixture("small.png");
        let mut zip_behind_png = png[..33].to_vec();
        zip_behind_png.extend_from_slice(b"PK\x03\x04\x14\x00\x00\x00\x08\x00 a zip archive from here on");
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("empty.txt", Vec::new(), "is empty"),
            ("fake.png", zip_behind_png, "not a whole image/png"),
            ("cut.png", png[..png.len() / 2].to_vec(), "not a whole image/png"),
            ("report.pdf", b"this is not a PDF".to_vec(), "not a PDF"),
            ("cut.pdf", fixture("note.pdf")[..200].to_vec(), "not a whole PDF"),
            ("archive.zip", b"PK\x03\x04\x14\x00\x00\x00\x08\x00rest".to_vec(), "application/zip"),
            ("../../etc/passwd", b"root".to_vec(), "is a path"),
            ("a\u{85}next line.txt", b"ding".to_vec(), "control characters"),
            ("binary.txt", vec![0xFF, 0xFE, 0, 0x41, 0x42], "not a kind of file"),
        ];
        for (name, bytes, why) in cases {
            let (status, error) = upload(&app, "ann", name, bytes).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{name:?}: {error}");
            assert_eq!(error["code"], "VALIDATION_ERROR");
            assert_eq!(error["field"], "attachments");
            assert!(error["message"].as_str().unwrap().contains(why), "{name:?}: {error}");
        }
        // Not multipart at all, and a part of another name.
        let (status, error) = app.post("/api/files", "ann", json!({"file": "x"})).await;
        assert_eq!((status, error["field"].as_str()), (StatusCode::BAD_REQUEST, Some("attachments")));
        let form = Form::new().part("attachment", Part::bytes(b"hello".to_vec()).file_name("a.txt"));
        let response = app.client.post(app.url("/api/files")).header("x-client-id", "ann").multipart(form).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        // A good file, then a second part: refused, and the good file is not kept either.
        let form = Form::new()
            .part("file", Part::bytes(fixture("small.png")).file_name("ok.png"))
            .part("more", Part::bytes(b"extra".to_vec()).file_name("b.txt"));
        let response = app.client.post(app.url("/api/files")).header("x-client-id", "ann").multipart(form).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert!(stored_files(&app).is_empty(), "no file, no part of one: {:?}", stored_files(&app));
    }

    async fn an_upload_past_the_limit_is_refused_as_it_passes_and_leaves_nothing(backend: Backend) {
        let app = TestApp::spawn(backend, "[files]\nmax_bytes = 1048576").await;
        // 25 MiB sent as a stream: the answer comes long before the body could have been sent.
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = sent.clone();
        let chunks = futures_util::stream::iter(0..400).map(move |_| {
            counter.fetch_add(65_536, std::sync::atomic::Ordering::Relaxed);
            Ok::<_, std::io::Error>(vec![b'a'; 65_536])
        });
        let part = Part::stream(reqwest::Body::wrap_stream(chunks)).file_name("big.txt");
        let form = Form::new().part("file", part);
        let response =
            app.client.post(app.url("/api/files")).header("x-client-id", "ann").multipart(form).send().await;
        // The server may close the connection on the client mid-body; when the answer arrives, it is a 413.
        if let Ok(response) = response {
            let status = response.status();
            let error: Value = response.json().await.unwrap();
            assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{error}");
            assert_eq!(error["code"], "PAYLOAD_TOO_LARGE");
            assert_eq!(error["field"], "attachments");
        }
        assert!(sent.load(std::sync::atomic::Ordering::Relaxed) < 25 * 1024 * 1024, "refused before the end");
        assert!(stored_files(&app).is_empty(), "nothing left behind: {:?}", stored_files(&app));
    }
}

use futures_util::StreamExt;

/// The user's message of a loaded conversation.
async fn user_message(app: &TestApp, user: &str, conversation: &str) -> Value {
    let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), user).await;
    loaded["messages"].as_array().unwrap().iter().find(|m| m["role"] == "user").cloned().unwrap()
}

both_backends! {
    async fn attachments_reach_the_model_and_the_message_keeps_them(backend: Backend) {
        let app = TestApp::spawn(backend, TAKES_FILES).await;
        let (_, photo) = upload(&app, "ann", "photo.jpg", fixture("photo.jpg")).await;
        let csv = data_url("text/csv", &fixture("cities.csv"));
        let frames = app
            .chat("ann", json!({"message": "What are these?", "attachments": [
                {"file_id": photo["id"]},
                {"url": csv, "name": "cities.csv"},
            ]}))
            .await;
        assert_eq!(frames.last().unwrap().kind(), "done");
        // The mock read the image's size from the bytes it was sent, and the text's lines.
        assert_eq!(
            joined(&frames, "text_delta"),
            "Mock reply: What are these? [1 image 640×480 jpeg] [1 text file cities.csv of 3 lines]"
        );
        let conversation = frames[0].data["conversation_id"].as_str().unwrap();
        let message = user_message(&app, "ann", conversation).await;
        let attachments = message["attachments"].as_array().unwrap();
        assert_eq!(attachments.len(), 2);
        assert_eq!(attachments[0]["file_id"], photo["id"]);
        assert_eq!(
            (attachments[0]["name"].as_str(), attachments[0]["media_type"].as_str(), attachments[0]["size"].as_u64()),
            (Some("photo.jpg"), Some("image/jpeg"), photo["size"].as_u64())
        );
        // The data: URL became a file of the user's, readable like an upload.
        assert_eq!((attachments[1]["name"].as_str(), attachments[1]["media_type"].as_str()), (Some("cities.csv"), Some("text/csv")));
        let csv_id = attachments[1]["file_id"].as_str().unwrap();
        let bytes = app.client.get(app.url(&format!("/api/files/{csv_id}"))).header("x-client-id", "ann").send().await.unwrap().bytes().await.unwrap();
        assert_eq!(bytes.to_vec(), fixture("cities.csv"));
        // A message may be a file alone.
        let alone = app.chat("ann", json!({"message": " ", "attachments": [{"file_id": photo["id"]}]})).await;
        assert!(joined(&alone, "text_delta").ends_with("[1 image 640×480 jpeg]"), "{:?}", joined(&alone, "text_delta"));
    }

    async fn an_attachment_that_cannot_be_taken_is_refused_before_the_stream_and_leaves_nothing(backend: Backend) {
        let app = TestApp::spawn(backend, TAKES_FILES).await;
        let (_, bobs) = upload(&app, "bob", "photo.jpg", fixture("photo.jpg")).await;
        let png = data_url("image/png", &fixture("small.png"));
        let cases = [
            // A text-only profile, naming the attachment.
            (json!({"message": "hi", "profile": "other", "attachments": [{"url": png, "name": "small.png"}]}), 400, "small.png"),
            (json!({"message": "hi", "attachments": [{"file_id": bobs["id"]}]}), 404, "not found"),
            (json!({"message": "hi", "attachments": [{"url": "data:image/png;base64,%%%not base64"}]}), 400, "base64"),
            (json!({"message": "hi", "attachments": [{"url": "data:text/plain,hello"}]}), 400, "only base64"),
            (json!({"message": "hi", "attachments": [{"url": data_url("text/plain", b"")}]}), 400, "is empty"),
            (json!({"message": "hi", "attachments": [{"url": png, "name": "../../x.png"}]}), 400, "is a path"),
            (json!({"message": "hi", "attachments": [{"url": "https://example.com/cat.png"}]}), 400, "fetch_remote"),
            (json!({"message": "hi", "attachments": [{"url": "ftp://example.com/cat.png"}]}), 400, "data: or http"),
            (json!({"message": "hi", "attachments": [{}]}), 400, "either file_id or url"),
            // A good file first, then a bad one: the first is not kept either.
            (json!({"message": "hi", "attachments": [{"url": png, "name": "ok.png"}, {"url": "data:image/png;base64,@"}]}), 400, "attachments[1]"),
        ];
        for (body, status, says) in cases {
            let (got, error) = app.post("/api/chat/stream", "ann", body.clone()).await;
            assert_eq!(got.as_u16(), status, "{body}: {error}");
            assert_eq!(error["field"], "attachments", "{error}");
            assert!(error["message"].as_str().unwrap().contains(says), "{says}: {error}");
        }
        let (_, list) = app.get("/api/conversations", "ann").await;
        assert_eq!(list["conversations"].as_array().unwrap().len(), 0, "no conversation was made");
        assert_eq!(stored_files(&app).len(), 1, "only bob's upload is kept: {:?}", stored_files(&app));
        let too_many: Vec<Value> = (0..11).map(|_| json!({"file_id": bobs["id"]})).collect();
        let (status, error) = app.post("/api/chat/stream", "bob", json!({"message": "hi", "attachments": too_many})).await;
        assert_eq!((status.as_u16(), error["field"].as_str()), (400, Some("attachments")));
    }

    async fn deleting_a_conversation_deletes_the_files_only_it_used(backend: Backend) {
        let app = TestApp::spawn(backend, TAKES_FILES).await;
        let (_, shared) = upload(&app, "ann", "photo.jpg", fixture("photo.jpg")).await;
        let (_, own) = upload(&app, "ann", "small.png", fixture("small.png")).await;
        let first = app.chat("ann", json!({"message": "one", "attachments": [{"file_id": shared["id"]}, {"file_id": own["id"]}]})).await;
        let second = app.chat("ann", json!({"message": "two", "attachments": [{"file_id": shared["id"]}]})).await;
        let conversation = first[0].data["conversation_id"].as_str().unwrap();
        assert_eq!(app.call(reqwest::Method::DELETE, &format!("/api/conversations/{conversation}"), "ann", None).await.0, StatusCode::NO_CONTENT);
        assert_eq!(app.get(&format!("/api/files/{}", own["id"].as_str().unwrap()), "ann").await.0, StatusCode::NOT_FOUND);
        assert_eq!(stored_files(&app).len(), 1, "the photo's bytes stay");
        let response = app.client.get(app.url(&format!("/api/files/{}", shared["id"].as_str().unwrap()))).header("x-client-id", "ann").send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "the other conversation still uses it");
        // A file deleted by its user stays named in the message, and is not sent again.
        assert_eq!(app.call(reqwest::Method::DELETE, &format!("/api/files/{}", shared["id"].as_str().unwrap()), "ann", None).await.0, StatusCode::NO_CONTENT);
        let other = second[0].data["conversation_id"].as_str().unwrap();
        assert_eq!(user_message(&app, "ann", other).await["attachments"][0]["name"], "photo.jpg");
        let third = app.chat("ann", json!({"message": "three", "conversation_id": other})).await;
        assert_eq!(third.last().unwrap().kind(), "done");
        assert!(stored_files(&app).is_empty());
    }

    async fn remote_urls_are_fetched_only_when_allowed_and_never_from_private_addresses(backend: Backend) {
        let app = TestApp::spawn(backend, &format!("{TAKES_FILES}\n[files]\nfetch_remote = true\n")).await;
        // Schemes are case-insensitive, and IPv4-compatible IPv6 carries the IPv4 address it
        // names (issue 34).
        for url in ["http://127.0.0.1:9/cat.png", "http://localhost:9/cat.png", "http://169.254.169.254/latest", "http://[::1]/x.png", "http://10.0.0.1/x.png",
            "HTTP://127.0.0.1:9/cat.png", "Http://localhost:9/cat.png", "http://[::127.0.0.1]:9/x.png", "http://[::7f00:1]:9/x.png", "http://[::ffff:7f00:1]:9/x.png"] {
            let (status, error) = app.post("/api/chat/stream", "ann", json!({"message": "hi", "attachments": [{"url": url}]})).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{url}: {error}");
            assert!(error["message"].as_str().unwrap().contains("private"), "{url}: {error}");
        }
    }
}

/// Rounds of a race between two users over the same bytes (issue 34): Ann's file, then at
/// once Ann deletes it and Bob uploads the same bytes. Bob's file must stay readable, whoever
/// wins: before the bytes were locked, Ann's "are they still used?" could answer no just
/// before Bob's row came, and her deletion then took his bytes (6 and 13 of 30 rounds).
pub async fn race_over_shared_bytes(deleter: &TestApp, uploader: &TestApp, rounds: usize) {
    for round in 0..rounds {
        let bytes = format!("shared note {round} {}\n", uuid::Uuid::now_v7()).into_bytes();
        let (status, anns) = upload(deleter, "ann", "note.txt", bytes.clone()).await;
        assert_eq!(status, StatusCode::CREATED, "{anns}");
        let path = format!("/api/files/{}", anns["id"].as_str().unwrap());
        let (deleted, (status, bobs)) = tokio::join!(
            deleter.call(reqwest::Method::DELETE, &path, "ann", None),
            upload(uploader, "bob", "note.txt", bytes.clone())
        );
        assert_eq!(deleted.0, StatusCode::NO_CONTENT);
        assert_eq!(status, StatusCode::CREATED, "{bobs}");
        let bobs = format!("/api/files/{}", bobs["id"].as_str().unwrap());
        let response = uploader.client.get(uploader.url(&bobs)).header("x-client-id", "bob").send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "round {round}: bob's fresh upload lost its bytes");
        assert_eq!(response.bytes().await.unwrap().to_vec(), bytes, "round {round}");
    }
}

both_backends! {
    async fn a_deletion_never_takes_the_bytes_of_an_upload_racing_it(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        race_over_shared_bytes(&app, &app, 30).await;
    }

    async fn an_attachment_whose_bytes_are_gone_fails_its_run_loudly(backend: Backend) {
        let app = TestApp::spawn(backend, TAKES_FILES).await;
        let (status, file) = upload(&app, "ann", "photo.jpg", fixture("photo.jpg")).await;
        assert_eq!(status, StatusCode::CREATED, "{file}");
        // The row stays; the bytes go (a storage fault, or an operator's mistake).
        for blob in stored_files(&app) {
            std::fs::remove_file(blob).unwrap();
        }
        let frames = app.chat("ann", json!({"message": "What is this?", "attachments": [{"file_id": file["id"]}]})).await;
        let error = frames.iter().find(|f| f.kind() == "error").unwrap_or_else(|| panic!("no error: {frames:?}"));
        assert_eq!(error.data["code"], "SERVICE_UNAVAILABLE");
        assert!(error.data["message"].as_str().unwrap().contains("photo.jpg could not be read"), "{error:?}");
        assert_eq!(frames.last().unwrap().kind(), "done");
        assert!(!joined(&frames, "text_delta").contains("left out"), "not answered without the file");
        let (status, error) = app.get(&format!("/api/files/{}", file["id"].as_str().unwrap()), "ann").await;
        assert_eq!((status, error["code"].as_str()), (StatusCode::SERVICE_UNAVAILABLE, Some("SERVICE_UNAVAILABLE")));
    }
}

/// The same race across two replicas sharing one Postgres and one file storage: the lock on
/// the bytes is the database's, not a process's.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_deletion_on_one_replica_never_takes_the_bytes_of_an_upload_on_another() {
    let db = TestDb::new(Backend::Postgres).await;
    let files = tempfile::tempdir().unwrap();
    let config = format!("[files]\nurl = \"file://{}\"\n", files.path().display());
    let (a, b) = (TestApp::on(&db.url, &config).await, TestApp::on(&db.url, &config).await);
    race_over_shared_bytes(&a, &b, 30).await;
}

/// A raw multipart body: `parts` between boundaries, as a client could send it.
async fn raw_upload(app: &TestApp, parts: &[String]) -> (StatusCode, Value) {
    let mut body = String::new();
    for part in parts {
        body.push_str(&format!("--b0undary\r\n{part}\r\n"));
    }
    body.push_str("--b0undary--\r\n");
    let response = app
        .client
        .post(app.url("/api/files"))
        .header("x-client-id", "ann")
        .header("content-type", "multipart/form-data; boundary=b0undary")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

both_backends! {
    /// Issue 34: a part's headers were held whole in memory, up to ~20 MiB each (100 such
    /// uploads at once took 2.9 GB). Past 8 KiB they are refused, and so is anything past the
    /// file part beyond that bound; nothing is stored.
    async fn multipart_heads_are_bounded(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let file = "Content-Disposition: form-data; name=\"file\"; filename=\"note.txt\"\r\n\r\nhello";
        let (status, stored) = raw_upload(&app, &[file.to_owned()]).await;
        assert_eq!(status, StatusCode::CREATED, "{stored}");
        let padded = |pad: usize| format!("X-Pad: {}\r\n{file}", "p".repeat(pad));
        let (status, stored) = raw_upload(&app, &[padded(7000)]).await;
        assert_eq!(status, StatusCode::CREATED, "a head under the bound is taken: {stored}");
        let (status, error) = raw_upload(&app, &[padded(1024 * 1024)]).await;
        assert_eq!((status, error["field"].as_str()), (StatusCode::BAD_REQUEST, Some("attachments")), "{error}");
        assert!(error["message"].as_str().unwrap().contains("headers are longer than 8192 bytes"), "{error}");
        // A second part with a long head, after a file: refused, the file with it.
        let second = format!("Content-Disposition: form-data; name=\"more\"\r\nX-Pad: {}\r\n\r\nx", "p".repeat(1024 * 1024));
        let (status, error) = raw_upload(&app, &[file.to_owned(), second]).await;
        assert_eq!((status, error["field"].as_str()), (StatusCode::BAD_REQUEST, Some("attachments")), "{error}");
        assert!(error["message"].as_str().unwrap().contains("one part"), "{error}");
        let kept = stored_files(&app);
        assert!(kept.len() == 1 && kept[0].to_string_lossy().contains("/blobs/"), "the accepted uploads' one blob, nothing temporary: {kept:?}");
    }
}
