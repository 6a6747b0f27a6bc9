//! Starting runs: a request is checked (`prepare`: everything that can fail with a status
//! code fails there, before any stream opens) and planned (`run::plan`), the user's message
//! and the traces are written in a group commit (`starts`), then each run goes to a task of
//! its own so it outlives the request that started it (or waits in the queue).

use std::sync::Arc;

use tokio::sync::oneshot;

use super::idempotency::{self, IdempotencyKey, Started};
use super::prepare::{ActionOutcome, Checked, Prepared, Preparer};
use super::starts::StartWriter;
use super::titles::Titles;
use crate::chat::control::queue::Queue;
use crate::chat::errors::{ChatError, busy};
use crate::chat::live::cluster::Cluster;
use crate::chat::live::log::EventLog;
use crate::chat::live::runs::{LiveRun, Runs};
use crate::chat::request::Begun;
use crate::chat::request::ChatRequest;
use crate::chat::run::agent::{self, RunPlan};
use crate::chat::run::attachments::Attachments;
use crate::chat::run::plan::{Planner, Side};
use crate::chat::shared::Shared;
use crate::config::Settings;
use crate::domain::{Comparison, Trace, TraceStatus, now};
use crate::ids::{ComparisonId, UserId};
use crate::outlive::outliving;
use crate::store::{Notice, RunStart, StartOutcome, Store};

/// How often a start looks again when other replicas keep starting runs of its conversation
/// before it is written.
const MOVED_TRIES: u32 = 5;

/// A start that other replicas kept overtaking.
fn moved() -> ChatError {
    ChatError::Unavailable("Runs of this conversation keep starting on other replicas; try again".into())
}

/// The 429 of a start another replica's runs took past its user's budget meanwhile (which
/// one is not told: the later to reset, where there are two).
fn over_budget_elsewhere(hold: Option<crate::store::BudgetHold>) -> ChatError {
    match hold {
        Some(hold) => super::budget::over_budget(&hold.budgets, hold.budgets.usd_per_month.is_some()),
        None => ChatError::Unavailable("the run could not start".into()),
    }
}

/// A start that panicked (a bug): its request fails.
fn gone(_: crate::outlive::Panicked) -> ChatError {
    ChatError::Unavailable("the run could not start".into())
}

/// Starts runs: checks, plans, writes and launches them (shared: `Arc<Starter>`).
pub(in crate::chat) struct Starter {
    settings: Arc<Settings>,
    pub(super) store: Arc<dyn Store>,
    runs: Runs,
    log: EventLog,
    starts: StartWriter,
    replica_id: std::sync::Arc<str>,
    cluster: Arc<dyn Cluster>,
    key_turns: idempotency::KeyTurns,
    preparer: Preparer,
    planner: Planner,
    attachments: Attachments,
    titles: Titles,
    queue: Queue,
    budgeter: super::budget::Budgeter,
}

impl Starter {
    pub(in crate::chat) fn new(shared: &Shared) -> Self {
        Self {
            settings: shared.settings.clone(),
            store: shared.store.clone(),
            runs: shared.runs.clone(),
            log: shared.log.clone(),
            starts: shared.starts.clone(),
            replica_id: shared.replica_id.clone(),
            cluster: shared.cluster.clone(),
            key_turns: shared.key_turns.clone(),
            preparer: Preparer::new(shared),
            planner: Planner::new(shared),
            attachments: Attachments::new(shared),
            titles: Titles::new(shared),
            queue: Queue::new(shared),
            budgeter: super::budget::Budgeter::new(shared),
        }
    }

    /// [`start`](Self::start), once per `Idempotency-Key` (CONTRACT.md §16): a request whose
    /// key started a run already gets that run's trace, to follow from its first event.
    pub(in crate::chat) async fn start_once(
        self: &Arc<Self>,
        user: &UserId,
        request: ChatRequest,
    ) -> Result<Started<Arc<LiveRun>>, ChatError> {
        let key = request.idempotency_key.clone();
        self.once(user, key, self.start(user, request)).await
    }

    /// [`start_comparison`](Self::start_comparison), once per `Idempotency-Key`: a repeat
    /// gets the comparison's first trace.
    pub(in crate::chat) async fn start_comparison_once(
        self: &Arc<Self>,
        user: &UserId,
        request: &ChatRequest,
        profile_a: &str,
        profile_b: &str,
    ) -> Result<Started<(Comparison, Arc<LiveRun>, Arc<LiveRun>)>, ChatError> {
        let key = request.idempotency_key.clone();
        self.once(user, key, self.start_comparison(user, request, profile_a, profile_b)).await
    }

    /// Runs `start` once per `Idempotency-Key` (see [`idempotency::once`]).
    pub(super) async fn once<T>(
        &self,
        user: &UserId,
        key: Option<IdempotencyKey>,
        start: impl Future<Output = Result<Begun<T>, ChatError>>,
    ) -> Result<Started<T>, ChatError> {
        idempotency::once(&*self.store, &self.key_turns, user, key, start).await
    }

    /// Validates and persists the request, then starts its run; returns the live run to follow.
    pub(in crate::chat) async fn start(
        self: &Arc<Self>,
        user: &UserId,
        request: ChatRequest,
    ) -> Result<Begun<Arc<LiveRun>>, ChatError> {
        // A client that leaves while its request is checked must not leave the files it sent
        // behind: the start goes on (or cleans up) in a task of its own then; while the
        // client waits, in its request's task (no trip through the runtime's queues).
        let (service, user) = (Arc::clone(self), user.clone());
        let start = async move { service.start_here(&user, request).await };
        outliving(crate::report::otlp::carrying_traceparent(start)).await.map_err(gone)?
    }

    async fn start_here(
        self: &Arc<Self>,
        user: &UserId,
        request: ChatRequest,
    ) -> Result<Begun<Arc<LiveRun>>, ChatError> {
        let (mut tries, action) = (0, ActionOutcome::new());
        loop {
            match self.try_start(user, &request, &action).await? {
                // Another replica started a run of the conversation since this one looked:
                // look again, to queue behind it (or refuse, or stop it).
                Begun::Moved if tries < MOVED_TRIES => tries += 1,
                Begun::Moved => return Err(moved()),
                begun => return Ok(begun),
            }
        }
    }

    async fn try_start(
        self: &Arc<Self>,
        user: &UserId,
        request: &ChatRequest,
        action: &ActionOutcome,
    ) -> Result<Begun<Arc<LiveRun>>, ChatError> {
        let Checked::Ready(turn) = self.preparer.prepare(user, request, 1, action).await? else {
            return Ok(Begun::KeyTaken);
        };
        let stored = turn.stored_files.clone();
        let profile = request
            .profile
            .clone()
            .or_else(|| turn.existing_profile.clone())
            .unwrap_or_else(|| self.settings.chat.default_profile.clone());
        let started = match self.planner.plan(user, &turn.ask(request), &profile, None) {
            Ok(side) => self.launch(user, *turn, vec![side], None).await,
            Err(e) => Err(e),
        };
        if !matches!(started, Ok(Begun::Started(_))) {
            // Nothing of a refused request stays: not the files it stored either.
            self.attachments.drop_files(user, &stored).await;
        }
        Ok(started?.map(|mut runs| runs.remove(0)))
    }

    /// Starts one message answered by two profiles side by side (CONTRACT.md §10): two full
    /// runs, two traces, one comparison; both answers become siblings under the message.
    pub(in crate::chat) async fn start_comparison(
        self: &Arc<Self>,
        user: &UserId,
        request: &ChatRequest,
        profile_a: &str,
        profile_b: &str,
    ) -> Result<Begun<(Comparison, Arc<LiveRun>, Arc<LiveRun>)>, ChatError> {
        let (service, user, request) = (Arc::clone(self), user.clone(), request.clone());
        let (profile_a, profile_b) = (profile_a.to_owned(), profile_b.to_owned());
        // As in `start`: the start outlives a client that leaves.
        outliving(crate::report::otlp::carrying_traceparent(async move {
            let (mut tries, action) = (0, ActionOutcome::new());
            loop {
                let Checked::Ready(turn) = service.preparer.prepare(&user, &request, 2, &action).await? else {
                    return Ok(Begun::KeyTaken);
                };
                let stored = turn.stored_files.clone();
                let started = service.compare(&user, &request, *turn, &profile_a, &profile_b).await;
                if !matches!(started, Ok(Begun::Started(_))) {
                    service.attachments.drop_files(&user, &stored).await;
                }
                match started? {
                    // As in `start_here`.
                    Begun::Moved if tries < MOVED_TRIES => tries += 1,
                    Begun::Moved => return Err(moved()),
                    begun => return Ok(begun),
                }
            }
        }))
        .await
        .map_err(gone)?
    }

    async fn compare(
        self: &Arc<Self>,
        user: &UserId,
        request: &ChatRequest,
        turn: Prepared,
        profile_a: &str,
        profile_b: &str,
    ) -> Result<Begun<(Comparison, Arc<LiveRun>, Arc<LiveRun>)>, ChatError> {
        let comparison_id = ComparisonId::new();
        let a = self.planner.plan(user, &turn.ask(request), profile_a, Some((comparison_id, "a")))?;
        let b = self.planner.plan(user, &turn.ask(request), profile_b, Some((comparison_id, "b")))?;
        let comparison = Comparison {
            comparison_id,
            conversation_id: turn.conversation_id,
            user_id: user.to_owned(),
            user_message_id: turn.user_message.id,
            trace_a: a.trace.trace_id,
            trace_b: b.trace.trace_id,
            profile_a: profile_a.to_owned(),
            profile_b: profile_b.to_owned(),
            model_a: a.trace.model.clone(),
            model_b: b.trace.model.clone(),
            preference: None,
            voted_at: None,
            vote_history: Vec::new(),
            created_at: now(),
        };
        let begun = self.launch(user, turn, vec![a, b], Some(comparison.clone())).await?;
        Ok(begun.map(|mut runs| {
            let run_b = runs.pop().expect("two runs");
            let run_a = runs.pop().expect("two runs");
            (comparison, run_a, run_b)
        }))
    }

    /// Persists the message and the traces in one transaction, then starts each run in a
    /// task of its own.
    async fn launch(
        self: &Arc<Self>,
        user: &UserId,
        turn: Prepared,
        sides: Vec<Side>,
        comparison: Option<Comparison>,
    ) -> Result<Begun<Vec<Arc<LiveRun>>>, ChatError> {
        let (mut traces, mut plans): (Vec<Trace>, Vec<RunPlan>) = sides.into_iter().map(|s| (s.trace, s.plan)).unzip();
        if turn.queued {
            for trace in &mut traces {
                trace.status = TraceStatus::Queued;
            }
        }
        // Checked last, on the plans: a user's starts take turns until each is written.
        let (budget, _budget_turn) = match self.budgeter.hold(user, &plans).await? {
            Some((hold, turn)) => (Some(hold), Some(turn)),
            None => (None, None),
        };
        // Each run's first model call goes out now, while its start is written, and the model
        // answers meanwhile. A start refused at its commit (another replica's runs or starts
        // won a race) drops that call unread; a user with a budget waits for the commit, so
        // that nothing is asked of a model that the budget does not count.
        if !turn.queued {
            for plan in plans.iter_mut().filter(|plan| plan.budgets.is_none()) {
                agent::send_early(plan);
            }
        }
        let start = RunStart {
            asked: turn.asked.kept(),
            seen: turn.seen,
            new_conversation: turn.new_conversation,
            user_message: turn.user_message,
            user_message_is_new: turn.user_message_is_new,
            traces,
            comparison,
            replica_id: self.replica_id.to_string(),
            max_running: turn.max_running,
            idempotency_key: turn.idempotency_key,
            budget,
        };
        let reservation = turn.reservation;
        // Until the runs are started, the conversation's next message waits.
        let _conversation_turn = turn.conversation_turn;
        // The start writer launches the runs right after the commit, whether or not this
        // request is still waiting: a client that leaves meanwhile must not leave a run
        // persisted as running that nobody runs.
        let (done, launched) = oneshot::channel();
        let service = Arc::clone(self);
        let user = user.to_owned();
        self.starts.write(start, move |start, written| {
            let runs = match written {
                Ok(StartOutcome::Started) => Ok(Begun::Started(service.run_written(&user, start, plans))),
                // Other replicas' runs filled the user's limit meanwhile.
                Ok(StartOutcome::OverLimit(running)) => Err(busy(running)),
                Ok(StartOutcome::KeyTaken) => Ok(Begun::KeyTaken),
                Ok(StartOutcome::Moved) => Ok(Begun::Moved),
                Ok(StartOutcome::ChatTaken) => Ok(Begun::ChatTaken),
                // Other replicas' runs spent or hold the budget meanwhile.
                Ok(StartOutcome::OverBudget) => Err(over_budget_elsewhere(start.budget)),
                Err(e) => Err(e.into()),
            };
            // The runs are registered now (or will never be): they count themselves, and
            // must not be counted twice by a start that checks meanwhile.
            drop(reservation);
            let _ = done.send(runs);
        });
        launched.await.map_err(|_| ChatError::Unavailable("the run could not start".into()))?
    }

    /// Registers and spawns the runs of a start that is in the database.
    fn run_written(&self, user: &UserId, start: RunStart, plans: Vec<RunPlan>) -> Vec<Arc<LiveRun>> {
        let mut runs = Vec::new();
        for (plan, trace) in plans.into_iter().zip(&start.traces) {
            let (run, mut emitter) =
                self.runs.register(plan.trace_id, plan.message_id, plan.conversation_id, user, self.log.clone(), 0);
            agent::announce(&plan, &mut emitter);
            if trace.status == TraceStatus::Queued {
                // Planned again when its turn comes, on the answers before it.
                self.queue.hold_queued(trace.clone(), emitter);
            } else {
                let (store, runs) = (self.store.clone(), self.runs.clone());
                tokio::spawn(agent::supervise(Box::new(plan), emitter, store, runs, agent::Start::Fresh));
            }
            runs.push(run);
        }
        // Whoever follows the conversation (CONTRACT.md §16) looks again: here, and on the
        // other replicas.
        let conversation_id = start.user_message.conversation_id;
        for run in &runs {
            self.cluster.tell_soon(Notice::Started(conversation_id, run.trace_id));
        }
        if start.new_conversation.is_some() && self.settings.chat.refine_titles {
            if let Some(run) = runs.first() {
                self.titles.refine_title(
                    user,
                    start.user_message.conversation_id,
                    &start.user_message.content,
                    run.clone(),
                );
            }
        }
        runs
    }
}
