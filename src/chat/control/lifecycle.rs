//! What keeps runs honest across processes: this process's heartbeat (and, at each beat, the
//! runs of processes that died, continued by `takeover`), cancels asked by other replicas,
//! and the shutdown drain.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use super::takeover::Takeover;
use crate::chat::live::cluster::Cluster;
use crate::chat::live::news::RunNews;
use crate::chat::live::runs::Runs;
use crate::store::Notice;

/// Says this process is alive (one write per `runs.heartbeat_secs`), continues the runs of
/// replicas that went quiet (shared stores), cancels local runs that other replicas ask to
/// cancel, and passes the rest of their news on to whoever waits here; until `shutdown`.
pub(in crate::chat) fn spawn_background(
    takeover: Takeover,
    cluster: Arc<dyn Cluster>,
    runs: Runs,
    news: RunNews,
    replica_id: Arc<str>,
    beat: Duration,
    shutdown: CancellationToken,
) {
    let beat_stop = shutdown.clone();
    let store = takeover.store().clone();
    tokio::spawn(async move {
        // Alone on its store, a process has nobody to tell and no runs left to it but those
        // found at start-up.
        if !cluster.others_leave_runs() {
            return;
        }
        let mut tick = tokio::time::interval(beat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = beat_stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            cluster.heartbeat(&replica_id).await;
            takeover.drop_lost().await;
            takeover.recover(false).await;
        }
    });
    tokio::spawn(async move {
        let notices = match store.notices().await {
            Ok(Some(notices)) => notices,
            Ok(None) => return,
            Err(e) => {
                tracing::error!(error = %e, "cannot hear other replicas (cancels, logs of their runs)");
                return;
            }
        };
        let mut notices = Box::pin(notices.take_until(shutdown.cancelled_owned()));
        while let Some(notice) = notices.next().await {
            match notice {
                Notice::Cancel(trace_id) => {
                    if let Some(run) = runs.get(trace_id) {
                        tracing::info!(%trace_id, "cancel asked by another replica");
                        run.cancel.cancel();
                    }
                }
                notice => news.tell(notice),
            }
        }
    });
}

/// Drains for shutdown: no new runs; running ones get up to `grace` to finish. Where another
/// replica is alive to take them over (CONTRACT.md §19), the grace is short
/// ([`HANDOVER_GRACE`]) and the runs still going are handed over: stopped where they are,
/// without an end, and left to the others, who continue each from its last completed step.
/// Else they are cancelled (and persist their partial answers). Returns once all have ended
/// (or left) or a last bounded wait passed. Queued runs stay queued, in the store, for
/// another replica or the next start to take up (CONTRACT.md §16).
pub(in crate::chat) async fn drain(runs: &Runs, grace: Duration, takeover: &Takeover) {
    let hand_over = takeover.others_alive().await;
    let grace = if hand_over { grace.min(HANDOVER_GRACE) } else { grace };
    let running = || runs.all().into_iter().filter(|run| !run.is_queued());
    // Looked at again until none is left: a queued run whose turn came meanwhile runs too.
    let all_done = async {
        loop {
            let left: Vec<_> = running().filter(|run| !run.is_finished() && !run.is_parked()).collect();
            if left.is_empty() {
                return;
            }
            for run in left {
                run.finished().await;
            }
        }
    };
    if tokio::time::timeout(grace, all_done).await.is_err() {
        let left: Vec<_> = running().collect();
        if hand_over {
            // A run that is saving its end finishes it; the others stop where they are.
            let going: Vec<_> = left.iter().filter(|run| run.is_running()).collect();
            tracing::warn!(runs = going.len(), "grace period over; handing the remaining runs to the other replicas");
            for run in &going {
                run.hand_over.cancel();
            }
        } else {
            tracing::warn!(runs = left.len(), "grace period over; cancelling the remaining runs");
            for run in &left {
                run.cancel.cancel();
            }
        }
        let stopped = async {
            for run in &left {
                run.logged().await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(10), stopped).await;
        if hand_over {
            takeover.release_running().await;
        }
    }
    // Runs leave the registry once their log is written; give the last ones that moment.
    // (Queued runs leave as the drain begins: their logs too.)
    let logged = async {
        for run in runs.all() {
            run.logged().await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), logged).await;
}

/// How long a drain waits for running runs before it hands them over, where another replica
/// is alive to continue them: a run about to end ends here; a longer one goes on there,
/// its current model call made again.
pub const HANDOVER_GRACE: Duration = Duration::from_secs(1);
