//! What can be checked of the deployment without Docker: the image's command runs as the
//! Dockerfile starts it, docker-compose.yml is a real deployment whose settings check, and
//! the binary's own checks (config, pipes, ports) say what is wrong.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn repo(file: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(file)).unwrap()
}

/// `KEY: value` lines of the compose file's `chatd` service environment.
fn compose_env() -> Vec<(String, String)> {
    let compose = repo("docker-compose.yml");
    let service = compose.split("\n  chatd:\n").nth(1).expect("a chatd service");
    let environment = service.split("    environment:\n").nth(1).expect("an environment");
    environment
        .lines()
        .take_while(|l| l.starts_with("      "))
        .filter_map(|l| l.trim().split_once(": "))
        .map(|(k, v)| (k.to_owned(), v.trim_matches('"').to_owned()))
        .collect()
}

#[test]
fn the_compose_file_is_a_real_deployment_whose_settings_check() {
    // Docker's engine is not on every machine that runs the tests: what can be checked
    // without it is checked here (the compose file's own `docker compose config` needs it).
    let compose = repo("docker-compose.yml");
    let chatd = compose.split("\n  chatd:\n").nth(1).expect("a chatd service");
    assert!(chatd.contains("\"127.0.0.1:8080:8080\""), "published on the loopback address only");
    assert!(compose.contains("secrets:\n  chatd_tokens:\n    environment: CHATD_TOKENS"), "tokens from a secret");
    assert!(chatd.contains("healthcheck:") && chatd.contains("/readyz"), "a healthcheck");
    assert!(chatd.contains("- chatd-data:/data"), "chatd's data folder (the image's VOLUME) on a named volume");
    assert!(compose.contains("\nvolumes:\n  pgdata:\n  chatd-data:\n"), "both volumes are named");
    let jaeger = compose.split("\n  jaeger:\n").nth(1).expect("a trace collector");
    assert!(jaeger.contains("profiles: [\"tracing\"]"), "optional: started only with its profile");
    assert!(chatd.contains("OTEL_EXPORTER_OTLP_ENDPOINT: ${OTEL_EXPORTER_OTLP_ENDPOINT:-}"), "off unless asked for");
    // The mounted config, read where the container reads it from.
    let mount = chatd
        .lines()
        .find_map(|l| l.trim().strip_prefix("- ./").filter(|m| m.contains(":/etc/chatd/")))
        .expect("a mounted config");
    let (file, inside) = mount.split_once(':').unwrap();
    let inside = inside.trim_end_matches(":ro");
    let env = compose_env();
    assert!(env.iter().any(|(k, v)| k == "CHATD_CONFIG" && v == inside), "CHATD_CONFIG names the mounted file");
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("chatd_tokens");
    std::fs::write(&tokens, "s3cret-token alice\n").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_chatd"))
        .arg("check-config")
        .envs(env.iter().filter(|(k, _)| k.starts_with("CHATD_") && k != "CHATD_CONFIG").map(|(k, v)| (k, v)))
        .env("CHATD_CONFIG", Path::new(env!("CARGO_MANIFEST_DIR")).join(file))
        .env("CHATD_AUTH__TOKENS_FILE", &tokens) // the secret, as the container sees it
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let effective: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(effective["server"]["host"], "0.0.0.0");
    assert_eq!(effective["server"]["port"], 8080);
    assert_eq!(effective["server"]["json_logs"], true);
    assert_eq!(effective["auth"]["mode"], "token", "auth is on");
    let url = effective["database"]["url"].as_str().unwrap();
    assert!(url.starts_with("postgres://") && url.contains(":***@"), "the database URL's password is masked: {url}");
    let default = effective["chat"]["default_profile"].as_str().unwrap();
    let provider = effective["profiles"][default]["provider"].as_str().unwrap();
    assert_ne!(effective["providers"][provider]["kind"], "mock", "the default profile is a real model");
    let key = effective["providers"][provider]["api_key_env"].as_str().unwrap();
    assert!(env.iter().any(|(k, _)| k == key), "{key} is passed from the environment of docker compose");
}

#[test]
fn the_image_build_copies_every_target_the_manifest_names() {
    // Cargo refuses to build even one binary when a declared bench's file is missing, and
    // Docker cannot run here to find out.
    let dockerfile = repo("Dockerfile");
    let copies = |dir: &str| dockerfile.lines().any(|line| line.trim() == format!("COPY {dir} {dir}"));
    let manifest = repo("Cargo.toml");
    if manifest.contains("[[bench]]") {
        let dir = manifest
            .lines()
            .find_map(|line| line.strip_prefix("path = \"")?.split('/').next())
            .expect("a bench names its path");
        assert!(copies(dir), "the build stage copies {dir}/, the benches' folder");
    }
    for dir in ["src", "migrations", "config"] {
        assert!(copies(dir), "the build stage copies {dir}/");
    }
}

#[tokio::test]
async fn the_image_command_serves_from_any_folder() {
    let dockerfile = repo("Dockerfile");
    assert!(dockerfile.contains(r#"CMD ["chatd", "serve"]"#));
    let dir = tempfile::tempdir().unwrap();
    let port = crate::helpers::free_port();
    // No config folder where it runs: the defaults compiled into the binary apply.
    let mut child = Command::new(env!("CARGO_BIN_EXE_chatd"))
        .arg("serve")
        .current_dir(dir.path())
        .env("CHATD_SERVER__HOST", "127.0.0.1")
        .env("CHATD_SERVER__PORT", port.to_string())
        .env("CHATD_DATABASE__URL", format!("sqlite://{}/data/chatd.db", dir.path().display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let ready = loop {
        match reqwest::get(format!("http://127.0.0.1:{port}/readyz")).await {
            Ok(response) => break response.status(),
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("chatd serve did not start: {e}"),
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(ready, 200);
    assert!(dir.path().join("data/chatd.db").exists(), "the SQLite file and its folder were created");
}

#[tokio::test]
async fn a_sigbus_is_reported_before_it_ends_the_process() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let port = crate::helpers::free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_chatd"))
        .arg("serve")
        .env("CHATD_SERVER__PORT", port.to_string())
        .env("CHATD_DATABASE__URL", format!("sqlite://{}/chatd.db", dir.path().display()))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while reqwest::get(format!("http://127.0.0.1:{port}/healthz")).await.is_err() {
        assert!(Instant::now() < deadline, "chatd serve did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What SQLite's -shm mapping raises when its file cannot be backed.
    let sent = Command::new("kill").args(["-BUS", &child.id().to_string()]).status().unwrap();
    assert!(sent.success());
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert_eq!(status.signal(), Some(7), "it still ends by SIGBUS: {status:?}");
    assert!(stderr.contains("fatal SIGBUS") && stderr.contains("-shm"), "{stderr}");
}

#[test]
fn check_config_refuses_a_typo_naming_the_key_where_it_came_from_and_the_nearest_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("chatd.toml");
    std::fs::write(&file, "[server]\nprot = 9000\n").unwrap();
    let check = |config: Option<&Path>, env: &[(&str, &str)]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_chatd"));
        command.current_dir(dir.path()).envs(env.iter().copied());
        if let Some(config) = config {
            command.args(["--config", config.to_str().unwrap()]);
        }
        let output = command.arg("check-config").output().unwrap();
        (output.status.success(), String::from_utf8_lossy(&output.stderr).into_owned())
    };
    let (ok, said) = check(Some(&file), &[]);
    assert!(!ok, "a typo in a file stops check-config");
    assert!(said.contains("unknown key `server.prot`") && said.contains(&file.display().to_string()), "{said}");
    assert!(said.contains("did you mean `server.port`?"), "{said}");

    let (ok, said) = check(None, &[("CHATD_SERVER__PROT", "9000")]);
    assert!(!ok, "a typo in the environment stops check-config");
    assert!(said.contains("CHATD_SERVER__PROT") && said.contains("`server.port`"), "{said}");

    // A variable without `__` is not configuration: it is left alone (one that reads like a
    // key written with `_` gets a warning).
    let (ok, said) = check(None, &[("CHATD_SERVER_PORT", "9000"), ("CHATD_SOMETHING", "x")]);
    assert!(ok, "{said}");
    assert!(said.contains("CHATD_SERVER_PORT is not configuration") && said.contains("CHATD_SERVER__PORT"), "{said}");
    assert!(!said.contains("CHATD_SOMETHING"), "{said}");
}

#[test]
fn check_config_names_a_bad_choice_with_its_key_the_whole_path_and_the_choices() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("cfg")).unwrap();
    std::fs::create_dir(dir.path().join("run")).unwrap();
    let file = dir.path().join("cfg/typo3.toml");
    std::fs::write(&file, "[providers.vllm]\nkind = \"openai-compatible\"\nbase_url = \"http://127.0.0.1:8000/v1\"\n")
        .unwrap();
    // Given relative to where chatd runs, as a user types it.
    let output = Command::new(env!("CARGO_BIN_EXE_chatd"))
        .current_dir(dir.path().join("run"))
        .args(["--config", "../cfg/typo3.toml", "check-config"])
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{said}");
    let absolute = std::fs::canonicalize(&file).unwrap();
    assert!(
        said.contains(&format!(
            "config: providers.vllm.kind = \"openai-compatible\" in {} is not one of: \
             anthropic, openai, google, openai_compatible, mock (did you mean \"openai_compatible\"?)",
            absolute.display()
        )),
        "{said}"
    );
    assert!(!said.contains("default.") && !said.contains('`'), "{said}");
}

#[test]
fn every_example_config_passes_check_config() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples");
    let mut examples: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    examples.sort();
    assert!(examples.len() >= 8, "ollama, openai, anthropic, gemini, openrouter, vllm, llama.cpp, a/b");
    for example in examples {
        let output = Command::new(env!("CARGO_BIN_EXE_chatd"))
            .args(["--config", example.to_str().unwrap(), "check-config"])
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        let name = example.display();
        assert!(output.status.success(), "{name}: {}", String::from_utf8_lossy(&output.stderr));
        let effective: Value = serde_json::from_slice(&output.stdout).unwrap();
        let default = effective["chat"]["default_profile"].as_str().unwrap();
        let profiles = effective["profiles"].as_object().unwrap();
        assert!(profiles.contains_key(default), "{name}: its default profile is one of its profiles");
        assert!(profiles.values().all(|p| p["provider"] != "mock" || example.ends_with("ab.toml")), "{name}");
        // A model on the user's own machine is bounded: a small one left free rambles on.
        for (id, profile) in profiles {
            let base_url = effective["providers"][profile["provider"].as_str().unwrap()]["base_url"].as_str();
            if base_url.is_some_and(|url| url.contains("://127.0.0.1") || url.contains("://localhost")) {
                assert!(profile["max_tokens"].as_u64().is_some(), "{name}: the local profile {id} sets max_tokens");
            }
        }
        assert_eq!(effective["providers"]["mock"]["kind"], "mock", "{name}: the mock stays");
        let text = std::fs::read_to_string(&example).unwrap();
        assert!(
            text.contains(&format!(
                "chatd --config config/examples/{}",
                example.file_name().unwrap().to_str().unwrap()
            )),
            "{name} says how to run it"
        );
    }
}

#[test]
fn printing_to_a_closed_pipe_ends_quietly_and_a_sqlite_path_is_shown() {
    for command in ["openapi", "check-config"] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_chatd"))
            .arg(command)
            .env("CHATD_DATABASE__URL", "sqlite://data/where.db")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // `| head` that has read enough
        let output = child.wait_with_output().unwrap();
        let said = String::from_utf8_lossy(&output.stderr);
        assert!(!said.contains("panicked"), "{command}: {said}");
        assert!(output.status.success(), "{command}: {said}");
    }
    let output = Command::new(env!("CARGO_BIN_EXE_chatd"))
        .arg("check-config")
        .env("CHATD_DATABASE__URL", "sqlite://data/where.db")
        .output()
        .unwrap();
    let effective: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(effective["database"]["url"], "sqlite://data/where.db", "no password, nothing to mask");
}

#[test]
fn a_port_in_use_is_named_with_its_setting() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_chatd"))
        .current_dir(dir.path())
        .env("CHATD_SERVER__PORT", &port)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(said.contains(&format!("cannot listen on 127.0.0.1:{port}")) && said.contains("server.port"), "{said}");
    assert!(said.contains("another process"), "{said}");
}

#[test]
fn a_provider_and_profile_can_be_defined_by_variables_alone() {
    // As docs/operations.md shows it for docker compose.
    let vars = [
        ("CHATD_PROVIDERS__LOCAL__KIND", "openai_compatible"),
        ("CHATD_PROVIDERS__LOCAL__BASE_URL", "http://ollama:11434/v1"),
        ("CHATD_PROFILES__LOCAL__PROVIDER", "local"),
        ("CHATD_PROFILES__LOCAL__MODEL", "qwen3:0.6b"),
    ];
    let check = |extra: &[(&str, &str)]| {
        Command::new(env!("CARGO_BIN_EXE_chatd"))
            .arg("check-config")
            .envs(vars.iter().chain(extra).copied())
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap()
    };
    let refused = check(&[]);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("CHATD_CHAT__DEFAULT_PROFILE") && said.contains("local"),
        "{said}"
    );
    let output = check(&[("CHATD_CHAT__DEFAULT_PROFILE", "local")]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let effective: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(effective["providers"]["local"]["kind"], "openai_compatible");
    assert_eq!(effective["profiles"]["local"]["model"], "qwen3:0.6b");
}

#[tokio::test]
async fn a_second_ctrl_c_stops_at_once_and_the_first_says_how_long_the_drain_may_take() {
    let dir = tempfile::tempdir().unwrap();
    let port = crate::helpers::free_port();
    let log = dir.path().join("chatd.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_chatd"))
        .current_dir(dir.path())
        .env("CHATD_SERVER__PORT", port.to_string())
        .env("CHATD_SERVER__SHUTDOWN_GRACE_SECS", "60")
        .env("NO_COLOR", "1")
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while reqwest::get(format!("{base}/readyz")).await.is_err() {
        assert!(Instant::now() < deadline, "chatd did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A long answer keeps the drain waiting.
    let mut stream = reqwest::Client::new()
        .post(format!("{base}/api/chat/stream"))
        .header("x-client-id", "ann")
        .json(&serde_json::json!({"message": "[mock:words=400] [mock:delay=50]"}))
        .send()
        .await
        .unwrap();
    stream.chunk().await.unwrap().expect("the run has started");
    let pid = child.id() as libc::pid_t;
    // SAFETY: a signal to the child this test started.
    let interrupt = || unsafe { libc::kill(pid, libc::SIGINT) };
    interrupt();
    let waited = Instant::now();
    while !std::fs::read_to_string(&log).unwrap().contains("press Ctrl-C again") {
        assert!(waited.elapsed() < Duration::from_secs(10), "the first Ctrl-C says how long the drain may take");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(child.try_wait().unwrap().is_none(), "the first Ctrl-C drains (the answer has up to 60 s)");
    interrupt();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(waited.elapsed() < Duration::from_secs(10), "the second Ctrl-C stops at once");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status.code(), Some(130));
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("up to 60 s to finish") && said.contains("stopping at once"), "{said}");
}
