//! Marks the build for the Postgres tests: with `CHATD_TEST_POSTGRES_URL` set they run;
//! without it they are compiled as ignored, so `cargo test` reports them as skipped. And
//! tells the OpenAPI derive that the id types (src/ids.rs) are what they wrap on the wire.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(chatd_postgres_tests)");
    println!("cargo::rerun-if-env-changed=CHATD_TEST_POSTGRES_URL");
    if std::env::var_os("CHATD_TEST_POSTGRES_URL").is_some_and(|v| !v.is_empty()) {
        println!("cargo::rustc-cfg=chatd_postgres_tests");
    }
    println!("cargo::rerun-if-changed=migrations");
    utoipa_config::Config::new()
        .alias_for("ConversationId", "uuid::Uuid")
        .alias_for("MessageId", "uuid::Uuid")
        .alias_for("TraceId", "uuid::Uuid")
        .alias_for("ComparisonId", "uuid::Uuid")
        .alias_for("UserId", "String")
        .write_to_file();
}
