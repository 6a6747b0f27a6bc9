//! The web page at `/` and its assets: served from the binary with their content types,
//! revalidated by ETag, with no credentials needed; an unknown asset is the contract's 404.

use reqwest::StatusCode;
use reqwest::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, ETAG, IF_NONE_MATCH};

use crate::helpers::*;

#[tokio::test]
async fn the_page_and_its_assets_are_served() {
    // In token mode too: the page must load before the user has pasted a token.
    let app = TestApp::spawn(Backend::Sqlite, "[auth]\nmode = \"token\"\n[auth.tokens]\n\"tok-web\" = \"ann\"\n").await;

    let page = app.client.get(app.url("/")).send().await.unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    assert_eq!(page.headers()[CONTENT_TYPE], "text/html; charset=utf-8");
    assert_eq!(page.headers()[CACHE_CONTROL], "no-cache");
    assert!(page.headers()[CONTENT_SECURITY_POLICY].to_str().unwrap().contains("script-src 'self'"));
    let html = page.text().await.unwrap();
    assert!(html.starts_with("<!doctype html>"));
    assert!(html.contains(r#"<script type="module" src="/assets/app.js">"#));
    assert!(html.contains(r#"href="/assets/style.css""#));

    for (file, content_type) in [
        ("app.js", "text/javascript; charset=utf-8"),
        ("api.js", "text/javascript; charset=utf-8"),
        ("markdown.js", "text/javascript; charset=utf-8"),
        ("render.js", "text/javascript; charset=utf-8"),
        ("style.css", "text/css; charset=utf-8"),
    ] {
        let asset = app.client.get(app.url(&format!("/assets/{file}"))).send().await.unwrap();
        assert_eq!(asset.status(), StatusCode::OK, "{file}");
        assert_eq!(asset.headers()[CONTENT_TYPE], content_type, "{file}");
        assert_eq!(asset.headers()[CACHE_CONTROL], "no-cache", "{file}");
        let on_disk = std::fs::read(format!("{}/web/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        assert_eq!(asset.bytes().await.unwrap(), on_disk, "{file} is the file in web/");
    }
}

#[tokio::test]
async fn the_icon_is_served_where_pages_and_browsers_ask_for_it() {
    // In token mode too: a browser asks for it without the page's credentials.
    let app = TestApp::spawn(Backend::Sqlite, "[auth]\nmode = \"token\"\n[auth.tokens]\n\"tok-web\" = \"ann\"\n").await;
    let on_disk = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/web/favicon.svg")).unwrap();
    for path in ["/favicon.ico", "/favicon.svg"] {
        let icon = app.client.get(app.url(path)).send().await.unwrap();
        assert_eq!(icon.status(), StatusCode::OK, "{path}");
        assert_eq!(icon.headers()[CONTENT_TYPE], "image/svg+xml", "{path}");
        assert!(icon.headers()[CONTENT_SECURITY_POLICY].to_str().unwrap().contains("script-src 'self'"), "{path}");
        assert_eq!(icon.bytes().await.unwrap(), on_disk, "{path}");
    }
    for page in ["/", "/docs"] {
        let html = app.client.get(app.url(page)).send().await.unwrap().text().await.unwrap();
        assert!(html.contains(r#"<link rel="icon" href="/favicon.svg" type="image/svg+xml">"#), "{page}");
    }
}

#[tokio::test]
async fn an_unchanged_asset_is_revalidated_with_a_304() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let first = app.client.get(app.url("/assets/app.js")).send().await.unwrap();
    let etag = first.headers()[ETAG].clone();
    let again = app.client.get(app.url("/assets/app.js")).header(IF_NONE_MATCH, etag.clone()).send().await.unwrap();
    assert_eq!(again.status(), StatusCode::NOT_MODIFIED);
    assert_eq!(again.headers()[ETAG], etag);
    assert!(again.bytes().await.unwrap().is_empty());
    let other = app.client.get(app.url("/assets/style.css")).header(IF_NONE_MATCH, etag).send().await.unwrap();
    assert_eq!(other.status(), StatusCode::OK, "another file's ETag does not match");
}

#[tokio::test]
async fn an_unknown_asset_is_a_not_found_envelope() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    for path in ["/assets/nope.js", "/assets/..%2FCargo.toml", "/assets/index.html"] {
        let response = app.client.get(app.url(path)).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND, "{path}");
        assert_eq!(response.headers()[CONTENT_TYPE], "application/json", "{path}");
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body, serde_json::json!({"code": "NOT_FOUND", "message": "No such asset"}), "{path}");
    }
}

#[test]
fn the_image_build_has_the_page() {
    // The files are compiled in (include_bytes!): the Dockerfile's build stage needs them.
    let dockerfile = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile")).unwrap();
    assert!(dockerfile.lines().any(|line| line.trim() == "COPY web web"), "the build stage copies web/");
}
