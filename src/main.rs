//! The `chatd` binary: telemetry → config → App::build → run until SIGTERM / Ctrl-C.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use chatd::App;
use chatd::config::Settings;

#[derive(Parser)]
#[command(name = "chatd", version, about = "A chat backend for LLM apps")]
struct Cli {
    /// A TOML file layered over config/default.toml and config/local.toml.
    #[arg(long, env = "CHATD_CONFIG", global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the server (the default).
    Serve,
    /// Run the database migrations and exit.
    Migrate,
    /// Validate the configuration and print the effective one, secrets masked.
    CheckConfig,
    /// Print the OpenAPI 3.1 document of the API.
    Openapi,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    report_sigbus();
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref()) {
        Ok(settings) => settings,
        Err(e) => {
            // A person's mistake, not a crash: the message alone, no backtrace.
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    if settings.server.json_logs {
        tracing_subscriber::fmt().json().with_env_filter(filter).init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    match cli.command.unwrap_or(Command::Serve) {
        Command::Openapi => print(&chatd::http::openapi::document())?,
        Command::CheckConfig => print(&serde_json::to_string_pretty(&settings)?)?,
        Command::Migrate => {
            chatd::store::connect(settings.database.url.expose(), 1).await?;
            tracing::info!("migrations applied");
        }
        Command::Serve => {
            let grace = settings.server.shutdown_grace_secs;
            let app = match App::build(settings).await {
                Ok(app) => app,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    std::process::exit(1);
                }
            };
            let shutdown = app.shutdown_handle();
            tokio::spawn(async move {
                stop_signal().await;
                tracing::info!(
                    "draining: no new runs; running answers have up to {grace} s to finish \
                     (server.shutdown_grace_secs); press Ctrl-C again to stop at once"
                );
                tokio::spawn(async {
                    stop_signal().await;
                    tracing::warn!("stopping at once: running answers end here, as interrupted");
                    std::process::exit(130);
                });
                shutdown.graceful().await;
            });
            app.run().await?;
        }
    }
    Ok(())
}

/// Writes `text` and a newline to stdout; a reader that went away (`chatd openapi | head`)
/// ends the output quietly instead of a panic.
fn print(text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

async fn stop_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// SQLite maps its `-shm` file into memory. When that file cannot be backed (a full or
/// read-only filesystem, a file truncated or made immutable under it), the next access is a
/// SIGBUS, which ends the process with no word at all. This says what happened on stderr
/// first, then lets the signal end the process as it would have.
fn report_sigbus() {
    extern "C" fn on_sigbus(_: libc::c_int) {
        const MESSAGE: &[u8] = b"chatd: fatal SIGBUS: a memory-mapped file could not be read or written; \
            most often SQLite's -shm file beside the database, on a full or read-only filesystem: \
            check the database folder's free space and permissions\n";
        // Only async-signal-safe calls here. With the default action back, the signal raised
        // again (held until this returns) ends the process as SIGBUS does.
        unsafe {
            libc::write(2, MESSAGE.as_ptr().cast(), MESSAGE.len());
            libc::signal(libc::SIGBUS, libc::SIG_DFL);
            libc::raise(libc::SIGBUS);
        }
    }
    // SAFETY: the handler only makes async-signal-safe calls.
    unsafe {
        libc::signal(libc::SIGBUS, on_sigbus as *const () as libc::sighandler_t);
    }
}
