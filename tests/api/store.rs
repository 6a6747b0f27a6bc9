//! The shared store suite: the same cases against SQLite and Postgres, through the `Store`
//! trait alone.

use std::sync::Arc;

use chatd::domain::{
    CallStatus, ContextState, Conversation, LlmAttributes, Message, Role, Span, SpanTiming, Trace, TraceStatus, Usage,
    now,
};
use chatd::events::Sent;
use chatd::ids::{TraceId, UserId};
use chatd::store::{
    self, ConversationStore, NewEvent, PageCursor, RunFinish, RunStart, RunStore, Seen, StartOutcome, Store,
    StoreError, UsageGrouping, WaitStore,
};
use serde_json::json;

use crate::helpers::*;

async fn open(backend: Backend) -> (Arc<dyn Store>, TestDb) {
    let db = TestDb::new(backend).await;
    let store = store::connect(&db.url, 4).await.expect("store opens and migrates");
    (store, db)
}

/// A logged event's JSON, as stored.
fn json(event: &chatd::events::LoggedEvent) -> serde_json::Value {
    serde_json::from_str(event.data.get()).unwrap()
}

/// A model call's span, as a run records it.
fn llm_span() -> Span {
    let at = now();
    Span::Llm {
        timing: SpanTiming::new("chat m".into(), at, at),
        status: CallStatus::Ok,
        attributes: Box::new(LlmAttributes { request_model: "m".into(), output_tokens: 2, ..LlmAttributes::default() }),
    }
}

fn user(name: &str) -> UserId {
    UserId::new(name)
}

fn conversation(name: &str, title: &str) -> Conversation {
    Conversation::new(&user(name), title.into())
}

fn run_start(conversation: &Conversation, new: bool) -> RunStart {
    let user_message = Message::new(conversation.id, conversation.active_leaf_id, Role::User, "question".into());
    RunStart {
        new_conversation: new.then(|| conversation.clone()),
        comparison: None,
        user_message_is_new: true,
        traces: vec![Trace::start(&conversation.user_id, &user_message, "m", "p")],
        user_message,
        replica_id: "replica-a".into(),
        max_running: None,
        idempotency_key: None,
        asked: None,
        seen: None,
        budget: None,
    }
}

both_backends! {
    /// A start the database refuses is answered as its outcome, with nothing of it written:
    /// a key another start recorded first, a client chat another start made first.
    async fn a_refused_start_is_an_outcome_and_writes_nothing(backend: Backend) {
        let (store, _db) = open(backend).await;
        let key = chatd::domain::IdempotencyKey { key: "k1".into(), request_hash: "h".into() };
        let first = conversation("ann", "first");
        let mut start = run_start(&first, true);
        start.idempotency_key = Some(key.clone());
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        let second = conversation("ann", "second");
        let mut again = run_start(&second, true);
        again.idempotency_key = Some(key);
        assert_eq!(store.start_run(&again).await.unwrap(), StartOutcome::KeyTaken);
        assert!(matches!(store.get_conversation(&user("ann"), second.id).await, Err(StoreError::NotFound)));

        let chat = Conversation { external_id: Some("client-chat".into()), ..conversation("ann", "a chat") };
        assert_eq!(store.start_run(&run_start(&chat, true)).await.unwrap(), StartOutcome::Started);
        let twin = Conversation { external_id: Some("client-chat".into()), ..conversation("ann", "its twin") };
        assert_eq!(store.start_run(&run_start(&twin, true)).await.unwrap(), StartOutcome::ChatTaken);
        assert!(matches!(store.get_conversation(&user("ann"), twin.id).await, Err(StoreError::NotFound)));
        // Another user's chat may have that id.
        let bobs = Conversation { external_id: Some("client-chat".into()), ..conversation("bob", "bob's") };
        assert_eq!(store.start_run(&run_start(&bobs, true)).await.unwrap(), StartOutcome::Started);
        assert_eq!(store.list_conversations(&user("ann"), 10, None).await.unwrap().len(), 2);
    }
}

both_backends! {
    async fn a_run_is_written_whole_or_not_at_all(backend: Backend) {
        let (store, _db) = open(backend).await;
        let first = conversation("ann", "first");
        let start = run_start(&first, true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);

        // Reusing the trace id makes the last statement of the transaction fail.
        let second = conversation("ann", "second");
        let mut clash = run_start(&second, true);
        clash.traces[0].trace_id = start.traces[0].trace_id;
        assert!(store.start_run(&clash).await.is_err());
        assert!(matches!(store.get_conversation(&user("ann"), second.id).await, Err(StoreError::NotFound)));
        assert_eq!(store.list_conversations(&user("ann"), 10, None).await.unwrap().len(), 1);

        let span = llm_span();
        let mut answer = Message::new(first.id, Some(start.user_message.id), Role::Assistant, "answer".into());
        answer.id = start.traces[0].message_id;
        answer.usage = Some(Usage { input_tokens: 1, output_tokens: 2, ..Usage::default() });
        store
            .finish_run(&RunFinish {
                trace_id: start.traces[0].trace_id,
                user_id: start.traces[0].user_id.clone(),
                status: TraceStatus::Completed,
                ended_at: now(),
                usage: Usage { input_tokens: 1, output_tokens: 2, ..Usage::default() },
                cost_usd: Some(0.5),
                error: None,
                spans: vec![span.clone()],
                assistant_message: Some(answer.clone()),
            })
            .await
            .unwrap();
        let loaded = store.get_conversation(&user("ann"), first.id).await.unwrap();
        assert_eq!(loaded.message_count, 2);
        assert_eq!(loaded.active_leaf_id, Some(answer.id));
        let messages = store.messages(&user("ann"), first.id).await.unwrap();
        assert_eq!(messages, vec![start.user_message.clone(), answer]);
        let trace = store.get_trace(&user("ann"), start.traces[0].trace_id).await.unwrap();
        assert_eq!(trace.status, TraceStatus::Completed);
        assert_eq!(trace.spans, vec![span]);
        assert_eq!(store.trace_by_message(&user("ann"), trace.message_id).await.unwrap().trace_id, trace.trace_id);
    }

    /// What a run spent is kept apart from its conversation (CONTRACT.md §18): the sums
    /// come from the database, and deleting the conversation does not undo them.
    async fn what_runs_spend_is_summed_and_outlives_their_conversation(backend: Backend) {
        let (store, _db) = open(backend).await;
        let mut traces = Vec::new();
        for (who, cost) in [("ann", Some(0.25)), ("ann", None), ("bob", Some(1.0))] {
            let c = conversation(who, "spent");
            let start = run_start(&c, true);
            assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
            let usage = Usage { input_tokens: 100, output_tokens: 10, cache_read_tokens: Some(60), ..Usage::default() };
            store
                .finish_run(&RunFinish { usage, cost_usd: cost, ..ended(&start.traces[0], None) })
                .await
                .unwrap();
            traces.push((c, start.traces[0].clone()));
        }
        let trace = store.get_trace(&user("ann"), traces[0].1.trace_id).await.unwrap();
        assert_eq!(trace.cost.cost_usd, Some(0.25));
        let (from, to) = (now() - chrono::Duration::hours(1), now() + chrono::Duration::hours(1));
        store.delete_conversation(&user("ann"), traces[0].0.id).await.unwrap();
        let ann = store.usage_sums(Some(&user("ann")), from, to, UsageGrouping::Model).await.unwrap();
        assert_eq!(ann.len(), 1, "{ann:?}");
        let group = &ann[0];
        assert_eq!((group.runs, group.input_tokens, group.output_tokens, group.cache_read_tokens), (2, 200, 20, 120));
        // The run whose price was unknown adds nothing to the cost, and does not hide it.
        assert_eq!(group.cost_usd, Some(0.25));
        let everyone = store.usage_sums(None, from, to, UsageGrouping::User).await.unwrap();
        let keys: Vec<(&str, u64)> = everyone.iter().map(|g| (g.key.as_str(), g.runs)).collect();
        assert_eq!(keys, [("ann", 2), ("bob", 1)]);
        let today = store.usage_sums(None, from, to, UsageGrouping::Day).await.unwrap();
        assert_eq!(today.len(), 1);
        assert_eq!(today[0].key, now().format("%Y-%m-%d").to_string());
        assert_eq!(today[0].cost_usd, Some(1.25));
        // Outside the period: nothing.
        let before = store.usage_sums(None, from - chrono::Duration::days(2), from, UsageGrouping::Day).await.unwrap();
        assert!(before.is_empty());
    }

    async fn events_append_in_batches_and_read_back_after_a_seq(backend: Backend) {
        let (store, _db) = open(backend).await;
        let c = conversation("ann", "log");
        let start = run_start(&c, true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        let events: Vec<NewEvent> = (1..=2500)
            .map(|seq| NewEvent {
                trace_id: start.traces[0].trace_id,
                seq,
                at: now(),
                kind: "text_delta",
                data: Sent::text(&json!({"type": "text_delta", "text": format!("t{seq}")}).to_string()),
            })
            .collect();
        // Two batches: a resume point inside the first one must not repeat what came before.
        store.append_events(&events[..1000], &[]).await.unwrap();
        store.append_events(&events[1000..], &[]).await.unwrap();
        let after = store.trace_events(start.traces[0].trace_id, 990).await.unwrap();
        let seqs: Vec<i64> = after.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (991..=2500).collect::<Vec<_>>());
        assert_eq!(json(&after[0])["text"], "t991");
        assert_eq!(after[0].kind, "text_delta");
        assert_eq!(after[0].at, events[990].at);
        let all = store.trace_events(start.traces[0].trace_id, 0).await.unwrap();
        assert_eq!(all.len(), 2500);
        assert_eq!(json(all.last().unwrap())["text"], "t2500");
        assert!(store.trace_events(start.traces[0].trace_id, 2500).await.unwrap().is_empty());
    }

    async fn starts_written_together_are_all_or_nothing(backend: Backend) {
        let (store, _db) = open(backend).await;
        let (a, b) = (conversation("ann", "a"), conversation("bob", "b"));
        let (start_a, start_b) = (run_start(&a, true), run_start(&b, true));
        assert_eq!(store.start_runs(&[&start_a, &start_b]).await.unwrap(), StartOutcome::Started);
        assert_eq!(store.get_trace(&user("ann"), start_a.traces[0].trace_id).await.unwrap().status, TraceStatus::Running);
        assert_eq!(store.get_trace(&user("bob"), start_b.traces[0].trace_id).await.unwrap().status, TraceStatus::Running);
        // A start into a conversation that does not exist fails, and takes its group with it.
        let c = conversation("cat", "c");
        let good = run_start(&c, true);
        let orphan = run_start(&conversation("cat", "never stored"), false);
        assert!(store.start_runs(&[&good, &orphan]).await.is_err());
        assert!(matches!(store.get_conversation(&user("cat"), c.id).await, Err(StoreError::NotFound)));
        assert!(matches!(store.get_trace(&user("cat"), good.traces[0].trace_id).await, Err(StoreError::NotFound)));
        assert_eq!(store.start_run(&good).await.unwrap(), StartOutcome::Started);
        assert_eq!(store.get_conversation(&user("cat"), c.id).await.unwrap().title, "c");
    }

    /// A group's new conversations, messages and traces read back as they were given,
    /// every column, set and unset (Postgres binds each column of the group as one array).
    async fn a_groups_rows_read_back_as_they_were_given(backend: Backend) {
        let (store, _db) = open(backend).await;
        let mut full = conversation("ann", "a \"quoted\"\nt\u{ed}tle \u{1f600}");
        full.profile = Some("fast".into());
        full.system_prompt = Some("Be brief.".into());
        full.metadata = json!({"team": "ops", "n": [1, 2.5, null]});
        full.external_id = Some("chat-1".into());
        let bare = conversation("ann", "");
        let other = conversation("bob", "b");
        let mut starts: Vec<RunStart> = [&full, &bare, &other].map(|c| run_start(c, true)).into();
        let first = &mut starts[0];
        first.user_message.thinking = Some("hm".into());
        first.user_message.client_id = Some("msg-1".into());
        first.user_message.payloads = vec![json!({"kind": "card", "id": 7})];
        first.user_message.content = "line one\nline \"two\" \\ \u{e9}".into();
        first.traces[0].variant = Some("a".into());
        first.traces[0].comparison_id = Some(chatd::ids::ComparisonId::new());
        first.traces[0].traceparent = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
        first.traces[0].metadata = Some(json!({"tags": ["x"]}));
        let group: Vec<&RunStart> = starts.iter().collect();
        assert_eq!(store.start_runs(&group).await.unwrap(), StartOutcome::Started);
        for start in &starts {
            let (m, t) = (&start.user_message, &start.traces[0]);
            let mut c = start.new_conversation.clone().unwrap();
            (c.active_leaf_id, c.message_count, c.updated_at, c.last_message_at) =
                (Some(m.id), 1, m.created_at, m.created_at);
            assert_eq!(store.get_conversation(&c.user_id, c.id).await.unwrap(), c);
            assert_eq!(store.messages(&c.user_id, c.id).await.unwrap(), vec![m.clone()]);
            assert_eq!(store.get_trace(&c.user_id, t.trace_id).await.unwrap(), *t);
        }
    }

    async fn an_event_log_from_before_chunks_is_carried_over(backend: Backend) {
        // The log as versions before migration 0003 wrote it (a row per event), then the
        // migrations since (SQLite's 0004 moves the chunks to a table in write order, 0005
        // lists each run's chunks in its row of trace_logs), then the store reads it.
        let (store, db) = open(backend).await;
        let c = conversation("ann", "old log");
        let start = run_start(&c, true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        let trace_id = start.traces[0].trace_id;
        let at = now();
        let old = [
            json!({"type": "status", "message": "Thinking…"}),
            json!({"type": "text_delta", "text": "a \"quoted\"\nline, ünïcode"}),
            json!({"type": "done", "conversation_id": c.id}),
        ];
        macro_rules! rewind_and_migrate {
            ($pool:expr, $rewind:expr, $($migration:expr),+) => {{
                let pool = $pool;
                sqlx::raw_sql($rewind).execute(&pool).await.unwrap();
                for (seq, event) in (1_i64..).zip(&old) {
                    sqlx::query("insert into trace_events (trace_id, seq, at, type, data) values ($1, $2, $3, $4, $5)")
                        .bind(trace_id)
                        .bind(seq)
                        .bind(at)
                        .bind(event["type"].as_str())
                        .bind(sqlx::types::Json(event))
                        .execute(&pool)
                        .await
                        .unwrap();
                }
                $(sqlx::raw_sql(include_str!($migration)).execute(&pool).await.unwrap();)+
            }};
        }
        match backend {
            Backend::Sqlite => rewind_and_migrate!(
                sqlx::SqlitePool::connect(&db.url).await.unwrap(),
                "drop trigger traces_log_from; drop trigger trace_logs_take_their_chunks; drop index traces_unsealed; \
                 alter table traces drop column log_from; alter table traces drop column log_sealed; \
                 drop table trace_logs; drop table trace_event_chunks; \
                 create table trace_events (trace_id blob not null references traces (id) on delete cascade, \
                 seq integer not null, at text not null, type text not null, data text not null, \
                 primary key (trace_id, seq)) without rowid;",
                "../../migrations/sqlite/0003_event_chunks.sql",
                "../../migrations/sqlite/0004_event_chunks_in_write_order.sql",
                "../../migrations/sqlite/0005_event_log_sealed_per_run.sql"
            ),
            Backend::Postgres => rewind_and_migrate!(
                sqlx::PgPool::connect(&db.url).await.unwrap(),
                "drop table trace_event_chunks; \
                 create table trace_events (trace_id uuid not null references traces (id) on delete cascade, \
                 seq bigint not null, at timestamptz not null, type text not null, data jsonb not null, \
                 primary key (trace_id, seq));",
                "../../migrations/postgres/0003_event_chunks.sql"
            ),
        }
        let read = store.trace_events(trace_id, 0).await.unwrap();
        assert_eq!(read.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(read.iter().map(json).collect::<Vec<_>>(), old);
        assert_eq!(read[1].kind, "text_delta");
        // SQLite's date functions round to the millisecond; Postgres keeps every digit.
        assert!(read.iter().all(|e| (e.at - at).num_microseconds().unwrap().abs() < 1000), "{at} {read:?}");
        assert_eq!(store.trace_events(trace_id, 2).await.unwrap().len(), 1);
    }

    async fn every_read_and_write_is_scoped_to_its_user(backend: Backend) {
        let (store, _db) = open(backend).await;
        let c = conversation("ann", "mine");
        let start = run_start(&c, true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        assert!(matches!(store.get_conversation(&user("bob"), c.id).await, Err(StoreError::NotFound)));
        assert!(store.messages(&user("bob"), c.id).await.unwrap().is_empty());
        assert!(matches!(store.set_feedback(&user("bob"), start.user_message.id, None).await, Err(StoreError::NotFound)));
        assert!(matches!(store.get_trace(&user("bob"), start.traces[0].trace_id).await, Err(StoreError::NotFound)));
        assert!(matches!(store.trace_by_message(&user("bob"), start.traces[0].message_id).await, Err(StoreError::NotFound)));
        assert!(matches!(store.delete_conversation(&user("bob"), c.id).await, Err(StoreError::NotFound)));
        let patch = chatd::store::ConversationPatch { title: Some("stolen".into()), ..Default::default() };
        assert!(matches!(store.update_conversation(&user("bob"), c.id, &patch).await, Err(StoreError::NotFound)));
        assert_eq!(store.get_conversation(&user("ann"), c.id).await.unwrap().title, "mine");
        store.delete_conversation(&user("ann"), c.id).await.unwrap();
        assert!(store.trace_events(start.traces[0].trace_id, 0).await.unwrap().is_empty());
        assert!(matches!(store.get_trace(&user("ann"), start.traces[0].trace_id).await, Err(StoreError::NotFound)));
    }

    async fn running_traces_carry_their_replica_and_heartbeat(backend: Backend) {
        let (store, _db) = open(backend).await;
        let c = conversation("ann", "live");
        let start = run_start(&c, true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        let running = store.running_traces().await.unwrap();
        assert_eq!(running.len(), 1);
        assert_eq!(running[0].replica_id.as_deref(), Some("replica-a"));
        assert_eq!(running[0].heartbeat_at, Some(start.traces[0].started_at));
        let later = start.traces[0].started_at + chrono::Duration::seconds(7);
        store.heartbeat("replica-b", later).await.unwrap();
        assert_eq!(store.running_traces().await.unwrap()[0].heartbeat_at, Some(start.traces[0].started_at), "another replica's beat");
        store.heartbeat("replica-a", later).await.unwrap();
        assert_eq!(store.running_traces().await.unwrap()[0].heartbeat_at, Some(later));
        assert_eq!(store.is_shared(), backend == Backend::Postgres);
    }

    async fn a_running_run_left_by_its_replica_is_taken_over_once_with_its_checkpoint(backend: Backend) {
        let (store, _db) = open(backend).await;
        let c = conversation("ann", "left running");
        let start = run_start(&c, true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        let id = start.traces[0].trace_id;
        let beat = start.traces[0].started_at + chrono::Duration::seconds(5);
        store.heartbeat("replica-a", beat).await.unwrap();
        let left = |quiet_since, me: &'static str| {
            let store = store.clone();
            async move {
                store.left_running(quiet_since, me).await.unwrap().into_iter().map(|r| r.trace.trace_id).collect::<Vec<_>>()
            }
        };
        assert!(left(beat - chrono::Duration::seconds(1), "b").await.is_empty(), "its replica beat since");
        assert_eq!(left(beat + chrono::Duration::seconds(1), "b").await, [id], "its replica went quiet");
        assert!(left(beat + chrono::Duration::seconds(1), "replica-a").await.is_empty(), "not to itself");
        // A step's checkpoint is written with the run's events, in their transaction.
        let event = chatd::store::NewEvent {
            trace_id: id,
            seq: 1,
            at: now(),
            kind: "status",
            data: Sent::text(r#"{"type":"status","message":"Thinking…"}"#),
        };
        let checkpoint = serde_json::json!({"seq": 1, "step": "kept"});
        let progress = chatd::store::Progress::of(id, &checkpoint);
        store.append_events(std::slice::from_ref(&event), std::slice::from_ref(&progress)).await.unwrap();
        assert_eq!(store.take_over(id, Some("someone else"), "b").await.unwrap(), None, "only from its holder");
        assert_eq!(store.take_over(id, Some("replica-a"), "b").await.unwrap(), Some(Some(checkpoint)));
        assert_eq!(store.take_over(id, Some("replica-a"), "c").await.unwrap(), None, "once");
        assert_eq!(store.held_elsewhere(&[id], "replica-a").await.unwrap(), [id], "the replica that lost it can tell");
        assert!(store.held_elsewhere(&[id], "b").await.unwrap().is_empty());
        // A replica may hold more runs than a statement takes binds (SQLite 32,766, Postgres 65,535).
        let many: Vec<_> = std::iter::repeat_with(TraceId::new).take(70_000).chain([id]).collect();
        assert_eq!(store.held_elsewhere(&many, "replica-a").await.unwrap(), [id], "among 70,001 runs");
        assert_eq!(store.running_traces().await.unwrap()[0].replica_id.as_deref(), Some("b"));
        // The log the other wrote is the log of the run that goes on.
        assert_eq!(store.trace_events(id, 0).await.unwrap().len(), 1);
    }

    async fn a_run_taken_over_after_a_restart_has_what_it_logs_since_in_its_log_while_it_runs(backend: Backend) {
        let (store, db) = open(backend).await;
        let c = conversation("ann", "restarted");
        let start = run_start(&c, true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        let id = start.traces[0].trace_id;
        let event = |seq: i64, message: &str| chatd::store::NewEvent {
            trace_id: id,
            seq,
            at: now(),
            kind: "status",
            data: Sent::text(&json!({"type": "status", "message": message}).to_string()),
        };
        store.append_events(&[event(1, "before")], &[]).await.unwrap();
        // The process stops; the next opens the store (SQLite seals what runs left at start-up)
        // and takes the run over, numbering its events past a gap.
        drop(store);
        let store = store::connect(&db.url, 4).await.unwrap();
        assert!(store.take_over(id, Some("replica-a"), "b").await.unwrap().is_some());
        store.append_events(&[event(1002, "after")], &[]).await.unwrap();
        // A follower that fell behind the run reads what it let go of from the log.
        let read: Vec<i64> = store.trace_events(id, 0).await.unwrap().iter().map(|e| e.seq).collect();
        assert_eq!(read, [1, 1002]);
        let since: Vec<i64> = store.trace_events(id, 1).await.unwrap().iter().map(|e| e.seq).collect();
        assert_eq!(since, [1002]);
    }

    async fn context_state_is_stored_replaced_and_deleted_with_the_conversation(backend: Backend) {
        let (store, _db) = open(backend).await;
        let c = conversation("ann", "long");
        store.create_conversation(&c).await.unwrap();
        assert_eq!(store.context_state(&user("ann"), c.id).await.unwrap(), None);
        let dropped = |dropped| ContextState { dropped, ..ContextState::default() };
        store.set_context_state(&user("ann"), c.id, Some(&dropped(2))).await.unwrap();
        store.set_context_state(&user("ann"), c.id, Some(&dropped(4))).await.unwrap();
        assert_eq!(store.context_state(&user("ann"), c.id).await.unwrap().unwrap().dropped, 4);
        assert_eq!(store.context_state(&user("bob"), c.id).await.unwrap(), None, "owner only");
        store.set_context_state(&user("ann"), c.id, None).await.unwrap();
        assert_eq!(store.context_state(&user("ann"), c.id).await.unwrap(), None);
        store.set_context_state(&user("ann"), c.id, Some(&ContextState::default())).await.unwrap();
        store.delete_conversation(&user("ann"), c.id).await.unwrap();
        assert_eq!(store.context_state(&user("ann"), c.id).await.unwrap(), None, "deleted with the conversation");
    }

    /// Messages added without a run (the Conversations API's items) follow the active
    /// branch in order and become its end; only a message nothing follows is deleted, and
    /// the one before it becomes the end again.
    async fn messages_are_appended_to_the_branch_and_the_last_one_deleted(backend: Backend) {
        let (store, _db) = open(backend).await;
        let ann = user("ann");
        let c = conversation("ann", "items");
        store.create_conversation(&c).await.unwrap();
        let message = |role, text: &str| Message::new(c.id, None, role, text.into());
        let first = store.append_messages(&ann, c.id, vec![message(Role::User, "one")]).await.unwrap();
        let more = vec![message(Role::Assistant, "two"), message(Role::User, "three")];
        let added = store.append_messages(&ann, c.id, more).await.unwrap();
        assert_eq!(added[0].parent_id, Some(first[0].id));
        assert_eq!(added[1].parent_id, Some(added[0].id));
        let loaded = store.get_conversation(&ann, c.id).await.unwrap();
        assert_eq!((loaded.active_leaf_id, loaded.message_count), (Some(added[1].id), 3));
        let refused = store.append_messages(&user("bob"), c.id, vec![message(Role::User, "mine?")]).await;
        assert!(matches!(refused, Err(StoreError::NotFound)), "another user's conversation");

        let followed = store.delete_last_message(&ann, added[0].id).await;
        assert!(matches!(followed, Err(StoreError::Conflict(_))), "a message another follows stays");
        store.delete_last_message(&ann, added[1].id).await.unwrap();
        let loaded = store.get_conversation(&ann, c.id).await.unwrap();
        assert_eq!((loaded.active_leaf_id, loaded.message_count), (Some(added[0].id), 2));
        let texts: Vec<String> = store.messages(&ann, c.id).await.unwrap().into_iter().map(|m| m.content).collect();
        assert_eq!(texts, ["one", "two"]);
    }

    /// An answer whose one turn is its text alone is stored once, as its content (it reads
    /// back without turns, and is sent to the model as that turn); turns that say more (a
    /// signed thinking block, a tool call, a text other than the content, several turns) are
    /// kept whole.
    async fn an_answers_turns_are_kept_only_where_they_say_more_than_its_text(backend: Backend) {
        use chatd::domain::{AssistantTurn, ThinkingBlock, ToolCall};
        let (store, _db) = open(backend).await;
        let ann = user("ann");
        let c = conversation("ann", "turns");
        store.create_conversation(&c).await.unwrap();
        let answer = |text: &str, turns: Vec<AssistantTurn>| Message {
            turns,
            ..Message::new(c.id, None, Role::Assistant, text.into())
        };
        let signed = AssistantTurn {
            thinking_blocks: vec![ThinkingBlock::Thinking { thinking: "hm".into(), signature: "sig==".into() }],
            ..AssistantTurn::of_text("two")
        };
        let call = ToolCall { id: "c1".into(), name: "calculator".into(), input: json!({}), invalid_arguments: None };
        let asking = AssistantTurn { tool_calls: vec![call], ..AssistantTurn::of_text("three") };
        let answers = vec![
            answer("one", vec![AssistantTurn::of_text("one")]),
            answer("two", vec![signed]),
            answer("three", vec![asking, AssistantTurn::of_text("four")]),
            answer("five\n\n[cancelled]", vec![AssistantTurn::of_text("five")]),
            answer("six", Vec::new()),
        ];
        store.append_messages(&ann, c.id, answers.clone()).await.unwrap();
        let read = store.messages(&ann, c.id).await.unwrap();
        assert_eq!(read.len(), answers.len());
        assert_eq!((read[0].content.as_str(), read[0].turns.as_slice()), ("one", &[][..]), "stored once");
        for (read, written) in read.iter().zip(&answers).skip(1) {
            assert_eq!(read.turns, written.turns, "{}: kept whole", written.content);
        }
    }

    async fn the_cursor_breaks_ties_on_equal_times(backend: Backend) {
        let (store, _db) = open(backend).await;
        let at = now();
        let mut made = Vec::new();
        for n in 0..4 {
            let mut c = conversation("ann", &format!("c{n}"));
            (c.created_at, c.updated_at, c.last_message_at) = (at, at, at);
            store.create_conversation(&c).await.unwrap();
            made.push(c.id);
        }
        let first = store.list_conversations(&user("ann"), 2, None).await.unwrap();
        let last = &first[1];
        let cursor = PageCursor { last_message_at: last.last_message_at, id: last.id };
        assert_eq!(last.last_message_at, at, "times come back exactly as written");
        let second = store.list_conversations(&user("ann"), 2, Some(cursor)).await.unwrap();
        let mut seen: Vec<_> = first.iter().chain(&second).map(|c| c.id).collect();
        made.sort();
        made.reverse();
        assert_eq!(seen, made, "ids break the tie, newest first");
        seen.dedup();
        assert_eq!(seen.len(), 4);
    }

    async fn a_chunk_written_twice_is_read_once(backend: Backend) {
        // A batch that failed halfway is retried run by run: chunks already in are written again.
        let (store, _db) = open(backend).await;
        let c = conversation("ann", "retried");
        let start = run_start(&c, true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        let events = text_deltas(start.traces[0].trace_id, 1..=3);
        store.append_events(&events, &[]).await.unwrap();
        store.append_events(&events, &[]).await.unwrap();
        let seqs: Vec<i64> = store.trace_events(start.traces[0].trace_id, 0).await.unwrap().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2, 3]);
        // A batch holding a chunk written already and a new one writes the new one.
        let other = run_start(&conversation("ann", "beside it"), true);
        assert_eq!(store.start_run(&other).await.unwrap(), StartOutcome::Started);
        let fresh = text_deltas(other.traces[0].trace_id, 1..=2);
        store.append_events(&[events, fresh].concat(), &[]).await.unwrap();
        let seqs: Vec<i64> = store.trace_events(other.traces[0].trace_id, 0).await.unwrap().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2]);
        assert_eq!(store.trace_events(start.traces[0].trace_id, 0).await.unwrap().len(), 3);
    }

    async fn a_batch_holding_a_deleted_runs_events_writes_the_others(backend: Backend) {
        // A conversation deleted while its run streams: the log writer's next batch still holds
        // that run's events. The batch is written without them, not refused whole (at 1,000
        // streams a refused batch is retried run by run, a transaction each).
        let (store, db) = open(backend).await;
        let (gone, kept) = (conversation("ann", "deleted"), conversation("ann", "kept"));
        let (a, b) = (run_start(&gone, true), run_start(&kept, true));
        assert_eq!(store.start_runs(&[&a, &b]).await.unwrap(), StartOutcome::Started);
        let (a_id, b_id) = (a.traces[0].trace_id, b.traces[0].trace_id);
        store.append_events(&[text_deltas(a_id, 1..=2), text_deltas(b_id, 1..=2)].concat(), &[]).await.unwrap();
        store.delete_conversation(&user("ann"), gone.id).await.unwrap();
        if backend == Backend::Postgres {
            assert_eq!(postgres_chunks(&db.url).await, 1, "a deleted run's chunks go with its trace");
        }

        store.append_events(&[text_deltas(a_id, 3..=4), text_deltas(b_id, 3..=4)].concat(), &[]).await.unwrap();
        let seqs: Vec<i64> = store.trace_events(b_id, 0).await.unwrap().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4]);
        assert!(store.trace_events(a_id, 0).await.unwrap().is_empty());
        if backend == Backend::Postgres {
            assert_eq!(postgres_chunks(&db.url).await, 2, "none written for the deleted run");
        }
    }

    async fn batches_of_any_number_of_runs_are_written_whole(backend: Backend) {
        // SQLite's insert of a batch is made once for each number of runs a transaction holds
        // (up to 100; a larger batch goes in several): small counts, a count again with other
        // events, counts up to and past a transaction's, checkpoints beside some and alone;
        // every run reads back exactly what it logged, and its last checkpoint.
        let (store, _db) = open(backend).await;
        let starts: Vec<RunStart> = (0..150).map(|n| run_start(&conversation("ann", &format!("run {n}")), true)).collect();
        assert_eq!(store.start_runs(&starts.iter().collect::<Vec<_>>()).await.unwrap(), StartOutcome::Started);
        let ids: Vec<TraceId> = starts.iter().map(|s| s.traces[0].trace_id).collect();
        let mut last = vec![0_i64; ids.len()];
        let mut checkpoints = std::collections::HashMap::new();
        for (round, count) in [1, 2, 3, 3, 64, 99, 100, 101, 150, 2].into_iter().enumerate() {
            // Each run's next two events, the runs interleaved as tokens arrive.
            let mut batch = Vec::new();
            for _ in 0..2 {
                for (n, id) in ids[..count].iter().enumerate() {
                    last[n] += 1;
                    batch.extend(text_deltas(*id, last[n]..=last[n]));
                }
            }
            let checkpoint = json!({"round": round, "runs": count});
            let progress = [chatd::store::Progress::of(ids[count - 1], &checkpoint)];
            let progress: &[chatd::store::Progress] = if count % 2 == 1 { &progress } else { &[] };
            if !progress.is_empty() {
                checkpoints.insert(ids[count - 1], checkpoint.clone());
            }
            store.append_events(&batch, progress).await.unwrap();
        }
        // A checkpoint alone, for a run without events in its batch.
        let alone = json!({"alone": true});
        store.append_events(&[], &[chatd::store::Progress::of(ids[149], &alone)]).await.unwrap();
        checkpoints.insert(ids[149], alone);
        for (n, id) in ids.iter().enumerate() {
            let events = store.trace_events(*id, 0).await.unwrap();
            let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
            assert_eq!(seqs, (1..=last[n]).collect::<Vec<_>>(), "run {n}");
            let texts: Vec<String> = events.iter().map(|e| json(e)["text"].as_str().unwrap().to_owned()).collect();
            assert_eq!(texts, (1..=last[n]).map(|seq| format!("t{seq}")).collect::<Vec<_>>(), "run {n}");
        }
        for (id, checkpoint) in checkpoints {
            assert_eq!(store.take_over(id, Some("replica-a"), "b").await.unwrap(), Some(Some(checkpoint)));
        }
    }
}

/// Rows in Postgres's table of the log's chunks.
async fn postgres_chunks(url: &str) -> i64 {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let (n,): (i64,) = sqlx::query_as("select count(*) from trace_event_chunks").fetch_one(&pool).await.unwrap();
    pool.close().await;
    n
}

fn text_deltas(trace_id: TraceId, seqs: std::ops::RangeInclusive<i64>) -> Vec<NewEvent> {
    seqs.map(|seq| NewEvent {
        trace_id,
        seq,
        at: now(),
        kind: "text_delta",
        data: Sent::text(&json!({"type": "text_delta", "text": format!("t{seq}")}).to_string()),
    })
    .collect()
}

/// The trace id of a run started in a new conversation of ann's.
async fn started_run(store: &Arc<dyn Store>, title: &str) -> TraceId {
    let start = run_start(&conversation("ann", title), true);
    assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
    start.traces[0].trace_id
}

/// Rows in SQLite's table of running runs' chunks.
async fn sqlite_chunks(url: &str) -> i64 {
    let pool = sqlx::SqlitePool::connect(url).await.unwrap();
    let (n,): (i64,) = sqlx::query_as("select count(*) from trace_event_chunks").fetch_one(&pool).await.unwrap();
    pool.close().await;
    n
}

#[tokio::test]
async fn sqlite_finds_a_runs_chunks_without_an_index_and_deletes_them_with_it() {
    let (store, db) = open(Backend::Sqlite).await;
    let (a, b) = (conversation("ann", "ended"), conversation("ann", "running"));
    let (ended, running) = (run_start(&a, true), run_start(&b, true));
    assert_eq!(store.start_runs(&[&ended, &running]).await.unwrap(), StartOutcome::Started);
    let (ended_id, running_id) = (ended.traces[0].trace_id, running.traces[0].trace_id);
    let log = text_deltas(ended_id, 1..=4);
    store.append_events(&log[..2], &[]).await.unwrap();
    store.append_events(&text_deltas(running_id, 1..=2), &[]).await.unwrap();
    store.append_events(&log[2..], &[]).await.unwrap();
    store.seal_logs(&[ended_id]).await.unwrap();
    let read = store.trace_events(ended_id, 1).await.unwrap();
    assert_eq!(read.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3, 4], "from the sealed list");
    assert_eq!(read[0].at, log[1].at);
    assert_eq!(json(&read[2])["text"], "t4");
    let running_log = store.trace_events(running_id, 0).await.unwrap();
    assert_eq!(running_log.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2], "from the chunks after log_from");
    // A later run starts after every chunk written so far: none of them is read as its own.
    let c = conversation("ann", "later");
    let later = run_start(&c, true);
    assert_eq!(store.start_run(&later).await.unwrap(), StartOutcome::Started);
    assert!(store.trace_events(later.traces[0].trace_id, 0).await.unwrap().is_empty());
    // A sealed log goes with its conversation, chunks and all; the other run's stay.
    assert_eq!(sqlite_chunks(&db.url).await, 3);
    store.delete_conversation(&user("ann"), a.id).await.unwrap();
    assert!(store.trace_events(ended_id, 0).await.unwrap().is_empty());
    assert_eq!(sqlite_chunks(&db.url).await, 1);
    assert_eq!(store.trace_events(running_id, 0).await.unwrap().len(), 2);
    // The chunks of a run deleted before it was sealed go when it is.
    store.delete_conversation(&user("ann"), b.id).await.unwrap();
    store.seal_logs(&[running_id]).await.unwrap();
    assert_eq!(sqlite_chunks(&db.url).await, 0);
}

#[tokio::test]
async fn sqlite_seals_the_logs_a_stopped_process_left_in_chunks() {
    let (store, db) = open(Backend::Sqlite).await;
    let trace_id = started_run(&store, "left over").await;
    let events = text_deltas(trace_id, 1..=5);
    store.append_events(&events[..3], &[]).await.unwrap();
    store.append_events(&events[2..], &[]).await.unwrap();
    drop(store);
    let reopened = store::connect(&db.url, 2).await.unwrap();
    let pool = sqlx::SqlitePool::connect(&db.url).await.unwrap();
    let (sealed,): (i64,) =
        sqlx::query_as("select log_sealed from traces where id = $1").bind(trace_id).fetch_one(&pool).await.unwrap();
    assert_eq!(sealed, 1);
    let read = reopened.trace_events(trace_id, 0).await.unwrap();
    assert_eq!(read.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3, 4, 5], "the repeated event once");
    assert_eq!(json(&read[4])["text"], "t5");
}

#[tokio::test]
async fn an_unreachable_postgres_is_named_at_once() {
    // Port 1 on this machine: nothing listens there, the connection is refused at once.
    let error = match store::connect("postgres://chatd@127.0.0.1:1/chatd", 2).await {
        Ok(_) => panic!("nothing listens on port 1"),
        Err(e) => e.to_string(),
    };
    assert!(error.contains("127.0.0.1:1"), "{error}");
    assert!(error.contains("\"chatd\""), "the database is named: {error}");
    assert!(error.contains("database.url"), "what to check: {error}");
}

/// A queued start of `conversation`: its message after `after` (an answer, stored or not).
fn queued_start(conversation: &Conversation, after: chatd::ids::MessageId) -> RunStart {
    let mut start = run_start(conversation, false);
    start.user_message.parent_id = Some(after);
    start.traces[0].status = TraceStatus::Queued;
    start.asked = Some(json!({"context": null, "client_tools": [], "diagnostics": false, "action_result": null}));
    start
}

/// `n` runs started, each in a new chat of ann's.
async fn new_chats(store: &Arc<dyn Store>, n: usize) -> Vec<RunStart> {
    let mut starts = Vec::new();
    for i in 0..n {
        let start = run_start(&conversation("ann", &format!("chat {i}")), true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        starts.push(start);
    }
    starts
}

/// The end of a start's first run, with its answer (under the id the start gave it).
fn answered(start: &RunStart) -> RunFinish {
    let (trace, question) = (&start.traces[0], &start.user_message);
    let mut answer = Message::new(question.conversation_id, Some(question.id), Role::Assistant, "a".into());
    answer.id = trace.message_id;
    ended(trace, Some(answer))
}

fn ended(trace: &Trace, answer: Option<Message>) -> RunFinish {
    RunFinish {
        trace_id: trace.trace_id,
        user_id: trace.user_id.clone(),
        status: if answer.is_some() { TraceStatus::Completed } else { TraceStatus::Error },
        ended_at: now(),
        usage: Usage::default(),
        cost_usd: None,
        error: None,
        spans: Vec::new(),
        assistant_message: answer,
    }
}

both_backends! {
    /// An end tried again after its first try was written (its answer lost with its
    /// connection: the run's end is tried again while the database seems unavailable) is told
    /// it was written, and writes nothing twice; another record of the run's end is refused.
    async fn an_end_tried_again_after_it_was_written_is_told_so(backend: Backend) {
        let (store, _db) = open(backend).await;
        let ann = user("ann");
        let start = &new_chats(&store, 1).await[0];
        let record = answered(start);
        store.finish_run(&record).await.unwrap();
        store.finish_run(&record).await.expect("the same end, tried again");
        let later = RunFinish { ended_at: record.ended_at + chrono::Duration::milliseconds(1), ..record.clone() };
        assert!(matches!(store.finish_run(&later).await, Err(StoreError::Conflict(_))));
        let cancelled = RunFinish { status: TraceStatus::Cancelled, ..record.clone() };
        assert!(matches!(store.finish_run(&cancelled).await, Err(StoreError::Conflict(_))));
        let conversation = store.get_conversation(&ann, start.user_message.conversation_id).await.unwrap();
        assert_eq!(conversation.message_count, 2, "its answer was written once");
        assert_eq!(store.messages(&ann, conversation.id).await.unwrap().len(), 2);
    }
}

both_backends! {
    /// Runs ending at once (a burst of answers, their ends queueing for the writer's places)
    /// are each told how their own end went: one whose run had already ended is refused and
    /// changes nothing, one that cannot be written fails alone, and every other is kept
    /// whole, its answer, trace, conversation and usage; the two answers of an A/B pair,
    /// ending at once, each count in their one conversation. (A guard for any way of writing
    /// ends together: Postgres writes the ends waiting for a turn as one statement.)
    async fn runs_ending_at_once_are_each_written_or_refused_on_their_own(backend: Backend) {
        let (store, db) = open(backend).await;
        let ann = user("ann");
        // Postgres writes the ends that wait for a turn 32 at most to a statement, taken in
        // the order they came: the clashing end fails the first statement (each of its ends
        // is then written alone), and the pair's two ends, well after it, go in later
        // statements, apart (one statement updates a conversation once).
        let (already, clashing, pair) = (0, 2, 40);
        let mut runs = Vec::new();
        for i in 0..150 {
            let c = conversation("ann", &format!("burst {i}"));
            let mut start = run_start(&c, true);
            if i == pair {
                let comparison = Some(chatd::ids::ComparisonId::new());
                let mut b = Trace::start(&ann, &start.user_message, "m", "p");
                (b.comparison_id, b.variant) = (comparison, Some("b".into()));
                let a = &mut start.traces[0];
                (a.comparison_id, a.variant) = (comparison, Some("a".into()));
                start.traces.push(b);
            }
            assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
            runs.push((c, start));
        }
        store.finish_run(&ended(&runs[already].1.traces[0], None)).await.unwrap();
        let mut records = Vec::new();
        for (i, (c, start)) in runs.iter().enumerate() {
            for trace in &start.traces {
                let mut answer = Message::new(c.id, Some(start.user_message.id), Role::Assistant, format!("answer {i}"));
                // This answer takes the id of another conversation's question: its insert fails.
                answer.id = if i == clashing { runs[1].1.user_message.id } else { trace.message_id };
                answer.variant = trace.variant.clone();
                let usage = Usage { input_tokens: 10 + i as u64, output_tokens: 1, ..Usage::default() };
                records.push(RunFinish { usage, ..ended(trace, Some(answer)) });
            }
        }
        let ends = records.into_iter().map(|record| {
            let store = store.clone();
            tokio::spawn(async move { store.finish_run(&record).await })
        });
        let mut outcomes: Vec<_> = futures_util::future::join_all(ends).await.into_iter().map(|o| o.unwrap()).collect();
        let b_outcome = outcomes.remove(pair + 1);

        for (i, ((c, start), outcome)) in runs.iter().zip(outcomes).enumerate() {
            let trace = store.get_trace(&ann, start.traces[0].trace_id).await.unwrap();
            let conversation = store.get_conversation(&ann, c.id).await.unwrap();
            let messages = store.messages(&ann, c.id).await.unwrap();
            match i {
                _ if i == pair => {
                    assert!(outcome.is_ok() && b_outcome.is_ok(), "{outcome:?}, {b_outcome:?}");
                    let b = store.get_trace(&ann, start.traces[1].trace_id).await.unwrap();
                    assert_eq!((trace.status, b.status), (TraceStatus::Completed, TraceStatus::Completed));
                    assert_eq!((messages.len(), conversation.message_count), (3, 3));
                    assert_eq!(conversation.active_leaf_id, Some(start.traces[0].message_id), "A keeps the branch");
                }
                _ if i == already => {
                    assert!(matches!(outcome, Err(StoreError::Conflict(_))), "{outcome:?}");
                    assert_eq!(trace.status, TraceStatus::Error, "the first end stands");
                    assert_eq!(messages.len(), 1, "no answer added");
                }
                _ if i == clashing => {
                    assert!(matches!(outcome, Err(StoreError::Database(_))), "{outcome:?}");
                    assert_eq!(trace.status, TraceStatus::Running, "nothing of the end is kept");
                    assert_eq!((messages.len(), conversation.message_count), (1, 1));
                }
                _ => {
                    assert!(outcome.is_ok(), "run {i}: {outcome:?}");
                    assert_eq!(trace.status, TraceStatus::Completed);
                    assert_eq!(trace.usage.map(|u| u.input_tokens), Some(10 + i as u64));
                    assert_eq!(messages.len(), 2);
                    assert_eq!(messages[1].content, format!("answer {i}"));
                    assert_eq!(conversation.message_count, 2);
                    assert_eq!(conversation.active_leaf_id, Some(start.traces[0].message_id));
                }
            }
        }
        let (from, to) = (now() - chrono::Duration::hours(1), now() + chrono::Duration::hours(1));
        let sums = store.usage_sums(Some(&ann), from, to, UsageGrouping::Model).await.unwrap();
        let kept: u64 = (0..150u64).filter(|&i| i != already as u64 && i != clashing as u64).map(|i| 10 + i).sum::<u64>()
            + (10 + pair as u64);
        assert_eq!(sums.iter().map(|g| g.input_tokens).sum::<u64>(), kept, "{sums:?}");
        if backend == Backend::Postgres {
            // The ends that waited went together: far fewer transactions closed the traces
            // than there were ends (a row's `xmin` is the transaction that last wrote it).
            let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
            let ids: Vec<uuid::Uuid> = runs.iter().flat_map(|(_, s)| s.traces.iter().map(|t| t.trace_id.0)).collect();
            let (commits,): (i64,) = sqlx::query_as("select count(distinct xmin::text) from traces where id = any($1)")
                .bind(&ids)
                .fetch_one(&pool)
                .await
                .unwrap();
            assert!(commits < ids.len() as i64 / 2, "{commits} transactions for {} ends", ids.len());
        }
    }
}

both_backends! {
    async fn a_queued_run_is_claimed_in_its_turn_and_its_message_follows_the_answer(backend: Backend) {
        use chatd::store::QueueTurn;
        let (store, _db) = open(backend).await;
        let ann = user("ann");
        let c = conversation("ann", "queue");
        let first = run_start(&c, true);
        assert_eq!(store.start_run(&first).await.unwrap(), StartOutcome::Started);
        let running = &first.traces[0];
        let second = queued_start(&c, running.message_id);
        assert_eq!(store.start_run(&second).await.unwrap(), StartOutcome::Started);
        let third = queued_start(&c, second.traces[0].message_id);
        assert_eq!(store.start_run(&third).await.unwrap(), StartOutcome::Started);
        let (q2, q3) = (&second.traces[0], &third.traces[0]);
        let going: Vec<TraceId> =
            store.running_in_conversation(&ann, c.id).await.unwrap().iter().map(|t| t.trace_id).collect();
        assert_eq!(going, [running.trace_id, q2.trace_id, q3.trace_id]);
        // Not before the runs ahead have ended, and in order.
        assert!(matches!(store.claim_queued(q2.trace_id, "r").await.unwrap(), QueueTurn::Behind(a) if a == [running.trace_id]));
        assert!(matches!(store.claim_queued(q3.trace_id, "r").await.unwrap(), QueueTurn::Behind(a) if a == [running.trace_id, q2.trace_id]));
        // The answer ends; the leaf stays on the message queued behind it.
        let mut answer = Message::new(c.id, Some(first.user_message.id), Role::Assistant, "one".into());
        answer.id = running.message_id;
        store.finish_run(&ended(running, Some(answer))).await.unwrap();
        assert_eq!(store.get_conversation(&ann, c.id).await.unwrap().active_leaf_id, Some(third.user_message.id));
        assert!(matches!(store.claim_queued(q3.trace_id, "r").await.unwrap(), QueueTurn::Behind(a) if a == [q2.trace_id]));
        match store.claim_queued(q2.trace_id, "r").await.unwrap() {
            QueueTurn::Claimed(Some(kept)) => assert_eq!(kept["diagnostics"], false),
            other => panic!("{other:?}"),
        }
        assert!(matches!(store.claim_queued(q2.trace_id, "r").await.unwrap(), QueueTurn::Gone(TraceStatus::Running)));
        // A run that ends without an answer: the message queued behind it follows its question.
        store.finish_run(&ended(q2, None)).await.unwrap();
        let messages = store.messages(&ann, c.id).await.unwrap();
        let moved = messages.iter().find(|m| m.id == third.user_message.id).unwrap();
        assert_eq!(moved.parent_id, Some(second.user_message.id));
        assert!(matches!(store.claim_queued(q3.trace_id, "r").await.unwrap(), QueueTurn::Claimed(_)));
        let mut last = Message::new(c.id, Some(third.user_message.id), Role::Assistant, "three".into());
        last.id = q3.message_id;
        store.finish_run(&ended(q3, Some(last.clone()))).await.unwrap();
        assert_eq!(store.get_conversation(&ann, c.id).await.unwrap().active_leaf_id, Some(last.id), "the last answer takes the leaf");
    }

    /// A run's end is written whole or not at all (on Postgres, without webhooks, it is one
    /// statement): where its answer cannot be stored, for another user, or after the run
    /// ended, neither the trace nor the conversation, its messages or the spend change.
    async fn a_runs_end_is_written_whole_or_not_at_all(backend: Backend) {
        let (store, _db) = open(backend).await;
        let ann = user("ann");
        let c = conversation("ann", "whole");
        let start = run_start(&c, true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        let (trace, question) = (&start.traces[0], &start.user_message);
        let (from, to) = (now() - chrono::Duration::hours(1), now() + chrono::Duration::hours(1));
        let spent = Usage { input_tokens: 7, output_tokens: 3, ..Usage::default() };
        let mut answer = Message::new(c.id, Some(question.id), Role::Assistant, "answer".into());
        answer.id = trace.message_id;
        let unchanged = async |messages: Vec<&Message>| {
            assert_eq!(store.get_trace(&ann, trace.trace_id).await.unwrap().status, TraceStatus::Running);
            let stored = store.get_conversation(&ann, c.id).await.unwrap();
            assert_eq!((stored.message_count, stored.active_leaf_id), (1, Some(question.id)));
            assert_eq!(store.messages(&ann, c.id).await.unwrap().iter().collect::<Vec<_>>(), messages);
            assert!(store.usage_sums(Some(&ann), from, to, UsageGrouping::Model).await.unwrap().is_empty());
        };

        // An answer whose id is taken (the question's) cannot be stored.
        let clash = Message { id: question.id, ..answer.clone() };
        let record = RunFinish { usage: spent, cost_usd: Some(0.5), ..ended(trace, Some(clash)) };
        assert!(store.finish_run(&record).await.is_err());
        unchanged(vec![question]).await;
        // Another user's record of the run is refused as if it had ended.
        let bobs = RunFinish { user_id: user("bob"), usage: spent, ..ended(trace, Some(answer.clone())) };
        assert!(matches!(store.finish_run(&bobs).await, Err(StoreError::Conflict(_))));
        unchanged(vec![question]).await;

        let record = RunFinish { usage: spent, cost_usd: Some(0.5), ..ended(trace, Some(answer.clone())) };
        store.finish_run(&record).await.unwrap();
        let later = Message::new(c.id, Some(question.id), Role::Assistant, "later".into());
        let usage = Usage { input_tokens: 100, ..Usage::default() };
        let again = RunFinish { usage, cost_usd: Some(9.0), ..ended(trace, Some(later)) };
        assert!(matches!(store.finish_run(&again).await, Err(StoreError::Conflict(_))));
        let stored = store.get_conversation(&ann, c.id).await.unwrap();
        assert_eq!((stored.message_count, stored.active_leaf_id), (2, Some(answer.id)));
        assert_eq!(store.messages(&ann, c.id).await.unwrap(), vec![question.clone(), answer]);
        let sums = store.usage_sums(Some(&ann), from, to, UsageGrouping::Model).await.unwrap();
        assert_eq!((sums[0].runs, sums[0].input_tokens, sums[0].output_tokens, sums[0].cost_usd), (1, 7, 3, Some(0.5)));
        let trace = store.get_trace(&ann, trace.trace_id).await.unwrap();
        assert_eq!((trace.status, trace.cost.cost_usd), (TraceStatus::Completed, Some(0.5)));
    }

    /// Runs that end at once (taking turns for the writer's queue) each get their own
    /// outcome: an end that cannot be stored, a second end of one run and another user's end
    /// are refused alone, and the others are written whole.
    async fn runs_that_end_at_once_each_get_their_own_outcome(backend: Backend) {
        let (store, _db) = open(backend).await;
        let ann = user("ann");
        let starts = new_chats(&store, 40).await;
        let answers: Vec<Message> = starts
            .iter()
            .map(|start| {
                let (trace, question) = (&start.traces[0], &start.user_message);
                let mut answer = Message::new(question.conversation_id, Some(question.id), Role::Assistant, "answer".into());
                answer.id = trace.message_id;
                answer
            })
            .collect();
        let mut records: Vec<RunFinish> =
            starts.iter().zip(&answers).map(|(s, a)| ended(&s.traces[0], Some(a.clone()))).collect();
        // Its answer's id is taken (its question's): it cannot be stored.
        let clash = Message { id: starts[3].user_message.id, ..answers[3].clone() };
        records[3].assistant_message = Some(clash);
        // Another user's end of a run.
        records[7].user_id = user("bob");
        // A second end of one run, beside its first.
        records.push(ended(&starts[11].traces[0], None));
        // Two waves: in the first, ends that are refused beside ends that are written; in
        // the second, one that fails its transaction beside ends that are written.
        let waves = [(0..40).filter(|i| *i != 3 && *i < 30).chain([40]).collect::<Vec<_>>(), (30..40).chain([3]).collect()];
        let mut outcomes: Vec<Option<Result<(), StoreError>>> = (0..records.len()).map(|_| None).collect();
        for wave in waves {
            let ended = futures_util::future::join_all(wave.iter().map(|&i| store.finish_run(&records[i]))).await;
            for (i, outcome) in wave.into_iter().zip(ended) {
                outcomes[i] = Some(outcome);
            }
        }
        let outcomes: Vec<Result<(), StoreError>> = outcomes.into_iter().map(Option::unwrap).collect();
        for (i, outcome) in outcomes.iter().enumerate() {
            match i {
                3 => assert!(matches!(outcome, Err(e) if !matches!(e, StoreError::Conflict(_))), "{i}: {outcome:?}"),
                7 => assert!(matches!(outcome, Err(StoreError::Conflict(_))), "{i}: {outcome:?}"),
                _ => {}
            }
        }
        // Of the two ends of one run, one was written and the other refused, in either order.
        let (first, second) = (&outcomes[11], &outcomes[40]);
        assert!(first.is_ok() != second.is_ok(), "{first:?}, {second:?}");
        assert!(matches!(if first.is_ok() { second } else { first }, Err(StoreError::Conflict(_))));
        for (i, start) in starts.iter().enumerate() {
            let trace = store.get_trace(&ann, start.traces[0].trace_id).await.unwrap();
            let stored = store.get_conversation(&ann, start.user_message.conversation_id).await.unwrap();
            let messages = store.messages(&ann, stored.id).await.unwrap();
            match i {
                3 | 7 => {
                    assert!(outcomes[i].is_err(), "{i}");
                    assert_eq!(trace.status, TraceStatus::Running, "{i}: nothing of it was written");
                    assert_eq!((stored.message_count, messages.len()), (1, 1), "{i}");
                }
                11 if outcomes[40].is_ok() => {
                    assert_eq!(trace.status, TraceStatus::Error, "{i}: ended without its answer");
                    assert_eq!(messages.len(), 1, "{i}");
                }
                _ => {
                    assert!(outcomes[i].is_ok(), "{i}: {:?}", outcomes[i]);
                    assert_eq!(trace.status, TraceStatus::Completed, "{i}");
                    assert_eq!((stored.message_count, stored.active_leaf_id), (2, Some(start.traces[0].message_id)), "{i}");
                    assert_eq!(messages, vec![start.user_message.clone(), answers[i].clone()], "{i}");
                }
            }
        }
    }

    async fn a_queued_run_left_by_its_process_is_adopted_once(backend: Backend) {
        let (store, _db) = open(backend).await;
        let c = conversation("ann", "left");
        let first = run_start(&c, true);
        assert_eq!(store.start_run(&first).await.unwrap(), StartOutcome::Started);
        let queued = queued_start(&c, first.traces[0].message_id);
        assert_eq!(store.start_run(&queued).await.unwrap(), StartOutcome::Started);
        let id = queued.traces[0].trace_id;
        let left = store.queued_traces().await.unwrap();
        assert_eq!(left.iter().map(|t| t.trace.trace_id).collect::<Vec<_>>(), [id]);
        assert_eq!(left[0].replica_id.as_deref(), Some("replica-a"));
        assert!(!store.adopt_queued(id, Some("someone else"), "b").await.unwrap(), "only from its holder");
        assert!(store.adopt_queued(id, Some("replica-a"), "b").await.unwrap());
        assert!(!store.adopt_queued(id, Some("replica-a"), "c").await.unwrap(), "once");
        assert_eq!(store.queued_traces().await.unwrap()[0].replica_id.as_deref(), Some("b"));
        // Its holder's heartbeat keeps it; once the holder leaves it (a drain), not any more.
        let adopted_at = store.queued_traces().await.unwrap()[0].heartbeat_at.unwrap();
        let later = adopted_at + chrono::Duration::seconds(7);
        store.heartbeat("b", later).await.unwrap();
        assert_eq!(store.queued_traces().await.unwrap()[0].heartbeat_at, Some(later));
        assert!(store.adopt_queued(id, Some("b"), "").await.unwrap());
        let left = &store.queued_traces().await.unwrap()[0];
        assert_eq!(left.replica_id.as_deref(), Some(""), "held by nobody");
        assert_ne!(left.heartbeat_at, Some(later), "not by the beat of the replica that left it");
    }
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_start_that_missed_a_run_of_its_conversation_is_refused_as_moved() {
    let (store, _db) = open(Backend::Postgres).await;
    let c = conversation("ann", "moved");
    let first = run_start(&c, true);
    assert_eq!(store.start_run(&first).await.unwrap(), StartOutcome::Started);
    // Another replica's start saw nothing going: it would land beside the running run.
    let mut beside = run_start(&c, false);
    beside.seen = Some(Seen { going: Vec::new(), leaf: Some(first.user_message.id) });
    assert_eq!(store.start_run(&beside).await.unwrap(), StartOutcome::Moved);
    assert_eq!(store.messages(&user("ann"), c.id).await.unwrap().len(), 1, "nothing of it was written");
    // Having seen it, it is written.
    let trace = &first.traces[0];
    beside.seen = Some(Seen { going: vec![(trace.trace_id, trace.message_id)], leaf: Some(first.user_message.id) });
    assert_eq!(store.start_run(&beside).await.unwrap(), StartOutcome::Started);
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_start_that_missed_a_run_that_began_and_ended_since_it_looked_is_refused_as_moved() {
    let (store, _db) = open(Backend::Postgres).await;
    let c = conversation("ann", "moved");
    let answered = |start: &RunStart| {
        let mut answer = Message::new(c.id, Some(start.user_message.id), Role::Assistant, "answer".into());
        answer.id = start.traces[0].message_id;
        answer
    };
    let first = run_start(&c, true);
    assert_eq!(store.start_run(&first).await.unwrap(), StartOutcome::Started);
    store.finish_run(&ended(&first.traces[0], Some(answered(&first)))).await.unwrap();
    // Two replicas look at once: nothing going, the first answer the leaf.
    let looked = Conversation { active_leaf_id: Some(first.traces[0].message_id), ..c.clone() };
    let seen = Seen { going: Vec::new(), leaf: looked.active_leaf_id };
    let (mut one, mut other) = (run_start(&looked, false), run_start(&looked, false));
    (one.seen, other.seen) = (Some(seen.clone()), Some(seen));
    // One's run begins and ends before the other's start is written: nothing is going
    // when it is, and it would follow the first answer, beside the question that came since.
    assert_eq!(store.start_run(&one).await.unwrap(), StartOutcome::Started);
    store.finish_run(&ended(&one.traces[0], Some(answered(&one)))).await.unwrap();
    assert_eq!(store.start_run(&other).await.unwrap(), StartOutcome::Moved);
    assert_eq!(store.messages(&user("ann"), c.id).await.unwrap().len(), 4, "nothing of it was written");
    // Looking again, it follows the answer that came since.
    let again = Conversation { active_leaf_id: Some(one.traces[0].message_id), ..c.clone() };
    let mut other = run_start(&again, false);
    other.seen = Some(Seen { going: Vec::new(), leaf: again.active_leaf_id });
    assert_eq!(store.start_run(&other).await.unwrap(), StartOutcome::Started);
    // A run seen going may end meanwhile: its answer is the leaf then, and that is no move.
    let going = run_start(&Conversation { active_leaf_id: Some(other.user_message.id), ..c.clone() }, false);
    let trace = &other.traces[0];
    store.finish_run(&ended(trace, Some(answered(&other)))).await.unwrap();
    let mut behind = going;
    behind.traces[0].status = TraceStatus::Queued;
    behind.user_message.parent_id = Some(trace.message_id);
    behind.seen = Some(Seen { going: vec![(trace.trace_id, trace.message_id)], leaf: Some(other.user_message.id) });
    assert_eq!(store.start_run(&behind).await.unwrap(), StartOutcome::Started);
}

both_backends! {
    /// A group of starts that updates one conversation twice (two messages into it, one
    /// queued behind the other's run, which settles the message the group inserts) writes
    /// each as it would have been written alone, in order.
    async fn a_group_that_updates_a_conversation_twice_writes_both_in_order(backend: Backend) {
        let (store, _db) = open(backend).await;
        let ann = user("ann");
        let c = conversation("ann", "twice");
        let first = run_start(&c, true);
        assert_eq!(store.start_run(&first).await.unwrap(), StartOutcome::Started);
        store.finish_run(&ended(&first.traces[0], None)).await.unwrap();
        let stored = store.get_conversation(&ann, c.id).await.unwrap();
        let next = run_start(&stored, false);
        let behind = queued_start(&stored, next.traces[0].message_id);
        let other = conversation("ann", "other");
        let beside = run_start(&other, true);
        assert_eq!(store.start_runs(&[&next, &beside, &behind]).await.unwrap(), StartOutcome::Started);
        let loaded = store.get_conversation(&ann, c.id).await.unwrap();
        assert_eq!(loaded.message_count, 3, "each message counted");
        assert_eq!(loaded.active_leaf_id, Some(behind.user_message.id), "the later message is the leaf");
        let messages = store.messages(&ann, c.id).await.unwrap();
        let queued = messages.iter().find(|m| m.id == behind.user_message.id).unwrap();
        assert_eq!(queued.parent_id, Some(next.traces[0].message_id), "it waits for the answer still going");
        assert_eq!(store.get_conversation(&ann, other.id).await.unwrap().message_count, 1);
        // A group one of whose conversations is gone writes nothing.
        store.delete_conversation(&ann, other.id).await.unwrap();
        let (late, gone) = (run_start(&loaded, false), run_start(&other, false));
        assert!(matches!(store.start_runs(&[&late, &gone]).await, Err(StoreError::NotFound)));
        assert_eq!(store.get_conversation(&ann, c.id).await.unwrap().message_count, 3, "nothing of the group");
    }
}

/// A start on Postgres takes its user's lock with the key every other statement binds, for
/// any user id (quotes, backslashes, letters past ASCII): while another transaction holds
/// it, the start waits; the running runs it then counts include what that one committed.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_start_waits_for_its_users_lock_whatever_the_users_id() {
    use sqlx::Connection;
    let (store, db) = open(Backend::Postgres).await;
    let odd = r"o'brien\'; select 1; -- ünï";
    let c = conversation(odd, "odd");
    let mut first = run_start(&c, true);
    first.max_running = Some(1);
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut tx = holder.begin().await.unwrap();
    sqlx::query("select pg_advisory_xact_lock(hashtextextended($1, 7))").bind(odd).execute(&mut *tx).await.unwrap();
    let waiting = tokio::spawn({
        let store = store.clone();
        async move { store.start_run(&first).await.unwrap() }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the start waits for the lock");
    tx.commit().await.unwrap();
    assert_eq!(waiting.await.unwrap(), StartOutcome::Started);
    let mut second = run_start(&conversation(odd, "second"), true);
    second.max_running = Some(1);
    assert_eq!(store.start_run(&second).await.unwrap(), StartOutcome::OverLimit(1), "the first is counted");
    assert_eq!(store.list_conversations(&user(odd), 10, None).await.unwrap().len(), 1, "nothing of the refused one");
    // A start into a conversation that is not its user's is not found, and takes its group.
    let ann = conversation("ann", "ann's");
    assert_eq!(store.start_run(&run_start(&ann, true)).await.unwrap(), StartOutcome::Started);
    let loaded = store.get_conversation(&user("ann"), ann.id).await.unwrap();
    let not_bobs = Conversation { user_id: user("bob"), ..loaded.clone() };
    let (beside, intruder) = (run_start(&conversation("ann", "beside"), true), run_start(&not_bobs, false));
    assert!(matches!(store.start_runs(&[&beside, &intruder]).await, Err(StoreError::NotFound)));
    assert_eq!(store.messages(&user("ann"), ann.id).await.unwrap().len(), 1, "nothing of the group");
    assert_eq!(store.list_conversations(&user("ann"), 10, None).await.unwrap().len(), 1, "nor of the start beside it");
}

/// Starts `start` while another connection holds its user's lock: the statement of the
/// start that waits for the lock, once the start went through after it.
async fn statement_that_waits(store: &Arc<dyn Store>, url: &str, start: RunStart) -> String {
    use sqlx::Connection;
    let mut holder = sqlx::PgConnection::connect(url).await.unwrap();
    let mut tx = holder.begin().await.unwrap();
    sqlx::query("select pg_advisory_xact_lock(hashtextextended($1, 7))")
        .bind(start.traces[0].user_id.as_str())
        .execute(&mut *tx)
        .await
        .unwrap();
    let started = tokio::spawn({
        let store = store.clone();
        async move { store.start_run(&start).await.unwrap() }
    });
    let mut watcher = sqlx::PgConnection::connect(url).await.unwrap();
    let mut waiting = None;
    for _ in 0..200 {
        waiting = sqlx::query_scalar(
            "select query from pg_stat_activity \
             where wait_event_type = 'Lock' and wait_event = 'advisory' and datname = current_database()",
        )
        .fetch_optional(&mut watcher)
        .await
        .unwrap();
        if waiting.is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    tx.commit().await.unwrap();
    assert_eq!(started.await.unwrap(), StartOutcome::Started);
    waiting.expect("the start waited for the lock")
}

/// A group of starts that open new chats is one statement on Postgres, its own transaction,
/// which checks the users' running runs under their locks itself (migration 0016); a start
/// into a conversation that exists still begins a transaction, locks, writes and commits.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn new_chats_start_in_one_statement_on_postgres_and_other_starts_in_a_transaction() {
    let (store, db) = open(Backend::Postgres).await;
    let c = conversation("ann", "new");
    let mut new = run_start(&c, true);
    new.max_running = Some(2);
    // The writes' statement itself waits (the server keeps a query's first 1,024 bytes: its
    // writes; it ends with the check), not a `BEGIN` before it.
    let query = statement_that_waits(&store, &db.url, new).await;
    assert!(query.starts_with("with w0 as (insert into conversations"), "the statement waits: {query}");

    let loaded = store.get_conversation(&user("ann"), c.id).await.unwrap();
    let mut more = run_start(&loaded, false);
    more.max_running = Some(2);
    let query = statement_that_waits(&store, &db.url, more).await;
    assert!(query.starts_with("BEGIN; select pg_advisory_xact_lock"), "a transaction begun first: {query}");
    let mut third = run_start(&conversation("ann", "third"), true);
    third.max_running = Some(2);
    assert_eq!(store.start_run(&third).await.unwrap(), StartOutcome::OverLimit(2), "both counted");
}

/// Starts of new chats for one user at once on Postgres (where replicas share the limit,
/// the database checks it), from as many connections: the limit of running runs lets
/// exactly as many through, each refusal counts them, and a refused start leaves nothing.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn new_chats_at_once_stop_at_their_users_limit() {
    let (store, _db) = open(Backend::Postgres).await;
    let starts: Vec<_> = (0..12)
        .map(|i| {
            let mut start = run_start(&conversation("ann", &format!("chat {i}")), true);
            start.max_running = Some(5);
            start
        })
        .collect();
    let outcomes = futures_util::future::join_all(starts.iter().map(|start| {
        let store = store.clone();
        let start = start.clone();
        tokio::spawn(async move { store.start_run(&start).await.unwrap() })
    }))
    .await;
    let outcomes: Vec<StartOutcome> = outcomes.into_iter().map(Result::unwrap).collect();
    assert_eq!(outcomes.iter().filter(|o| **o == StartOutcome::Started).count(), 5, "{outcomes:?}");
    assert!(
        outcomes.iter().all(|o| matches!(o, StartOutcome::Started | StartOutcome::OverLimit(5))),
        "a refusal counts the five: {outcomes:?}"
    );
    assert_eq!(store.list_conversations(&user("ann"), 20, None).await.unwrap().len(), 5, "nothing of the refused");
}

both_backends! {
    async fn a_queued_message_whose_answer_will_never_come_follows_its_question(backend: Backend) {
        let (store, _db) = open(backend).await;
        let c = conversation("ann", "never");
        let first = run_start(&c, true);
        assert_eq!(store.start_run(&first).await.unwrap(), StartOutcome::Started);
        // The run ahead ends without an answer before the queued start is written.
        store.finish_run(&ended(&first.traces[0], None)).await.unwrap();
        let late = queued_start(&c, first.traces[0].message_id);
        assert_eq!(store.start_run(&late).await.unwrap(), StartOutcome::Started);
        let messages = store.messages(&user("ann"), c.id).await.unwrap();
        let stored = messages.iter().find(|m| m.id == late.user_message.id).unwrap();
        assert_eq!(stored.parent_id, Some(first.user_message.id), "it follows the question, not a missing answer");
        // A queued message after an answer still being written is left where it is.
        let going = run_start(&c, false);
        assert_eq!(store.start_run(&going).await.unwrap(), StartOutcome::Started);
        let behind = queued_start(&c, going.traces[0].message_id);
        assert_eq!(store.start_run(&behind).await.unwrap(), StartOutcome::Started);
        let messages = store.messages(&user("ann"), c.id).await.unwrap();
        assert_eq!(messages.iter().find(|m| m.id == behind.user_message.id).unwrap().parent_id, Some(going.traces[0].message_id));
    }
}

/// A refusal is no storage fault (issue 34): a missing or another user's approval, call or
/// answer is answered from inside a transaction, which is rolled back, and the one SQLite
/// writer is kept (it was closed and opened anew for each, with an ERROR logged).
#[tokio::test]
async fn refusals_keep_the_sqlite_writer() {
    let db = TestDb::new(Backend::Sqlite).await;
    let sqlite = store::SqliteStore::connect(&db.url, 4).await.expect("store opens");
    let ann = user("ann");
    for _ in 0..20 {
        let approval = store::WaitKey::Approval(uuid::Uuid::now_v7());
        let refused = sqlite.settle_wait(approval, Some(&ann), &store::Settlement::Approved, "replica-a").await;
        assert!(matches!(refused, Err(StoreError::NotFound)), "{refused:?}");
        let call = store::WaitKey::Call(TraceId::new(), "call_1");
        let refused = sqlite.settle_wait(call, Some(&ann), &store::Settlement::Approved, "replica-a").await;
        assert!(matches!(refused, Err(StoreError::NotFound)), "{refused:?}");
        let refused = sqlite.delete_answer(&ann, chatd::ids::MessageId::new()).await;
        assert!(matches!(refused, Err(StoreError::NotFound)), "{refused:?}");
    }
    assert_eq!(sqlite.writers_reopened(), 0, "a refusal closed the writer");
    // Writes still work on the writer kept.
    let c = conversation("ann", "after refusals");
    assert_eq!(sqlite.start_run(&run_start(&c, true)).await.unwrap(), StartOutcome::Started);
}

both_backends! {
    /// The lock on a file's bytes writes its row and tells whether any row names them (on
    /// Postgres a bare `select 1` is an int4, which its first version failed to read).
    async fn the_bytes_lock_writes_rows_and_tells_whether_bytes_are_used(backend: Backend) {
        let (store, _db) = open(backend).await;
        let sha256 = "ab".repeat(32);
        let file = |name: &str| chatd::domain::StoredFile {
            id: chatd::ids::FileId::new(),
            user_id: user("ann"),
            name: name.into(),
            media_type: "text/plain".into(),
            size: 5,
            sha256: sha256.clone(),
            width: None,
            height: None,
            created_at: now(),
        };
        let mut lock = store.lock_bytes(&sha256).await.unwrap();
        assert!(!lock.used().await.unwrap(), "no row names them yet");
        let (first, second) = (file("a.txt"), file("b.txt"));
        lock.insert_file(&first).await.unwrap();
        lock.insert_file(&second).await.unwrap();
        assert!(lock.used().await.unwrap());
        lock.release().await;
        store.delete_file(&user("ann"), first.id).await.unwrap();
        let mut lock = store.lock_bytes(&sha256).await.unwrap();
        assert!(lock.used().await.unwrap(), "the second file still has them");
        lock.release().await;
        store.delete_file(&user("ann"), second.id).await.unwrap();
        let mut lock = store.lock_bytes(&sha256).await.unwrap();
        assert!(!lock.used().await.unwrap(), "the last row is gone");
        lock.release().await;
    }
}

both_backends! {
    /// A webhook message is written in the same transaction as what it reports: a run's end
    /// writes one; an end refused (the run had ended) writes none; and where the message
    /// cannot be written, the end is not written either.
    async fn a_runs_end_and_its_webhook_message_are_one_write(backend: Backend) {
        use chatd::config::{WebhookEvent, WebhookSettings, WebhooksSettings};
        use chatd::store::DeliveryFilter;
        let (store, db) = open(backend).await;
        let mut settings = WebhooksSettings::default();
        let endpoint = WebhookSettings {
            url: "http://127.0.0.1:9/".into(),
            events: vec![WebhookEvent::RunCompleted, WebhookEvent::RunFailed],
            secret_env: None,
            secret_file: None,
            secret: None,
        };
        settings.endpoints.insert("billing".into(), endpoint);
        store.report_to(chatd::domain::webhook::Outbox::new(&settings));
        let all = DeliveryFilter { limit: 10, ..DeliveryFilter::default() };

        let first = conversation("ann", "first");
        let start = run_start(&first, true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        let mut answer = Message::new(first.id, Some(start.user_message.id), Role::Assistant, "answer".into());
        answer.id = start.traces[0].message_id;
        store.finish_run(&ended(&start.traces[0], Some(answer))).await.unwrap();
        let written = store.deliveries(&all).await.unwrap();
        assert_eq!(written.len(), 1);
        assert_eq!((written[0].event.as_str(), written[0].endpoint.as_str()), ("run.completed", "billing"));
        assert!(matches!(store.finish_run(&ended(&start.traces[0], None)).await, Err(StoreError::Conflict(_))));
        assert_eq!(store.deliveries(&all).await.unwrap().len(), 1, "a refused end reports nothing");
        assert_eq!(store.outbox_depth().await.unwrap(), 1);

        let second = conversation("ann", "second");
        let start = run_start(&second, true);
        assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
        const HIDE: &str = "alter table webhook_outbox rename to webhook_outbox_gone";
        match backend {
            Backend::Sqlite => {
                let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&db.url).await.unwrap();
                sqlx::query(HIDE).execute(&mut conn).await.unwrap();
            }
            Backend::Postgres => {
                let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url).await.unwrap();
                sqlx::query(HIDE).execute(&mut conn).await.unwrap();
            }
        }
        assert!(store.finish_run(&ended(&start.traces[0], None)).await.is_err(), "its message could not be written");
        let trace = store.get_trace(&user("ann"), start.traces[0].trace_id).await.unwrap();
        assert_eq!(trace.status, TraceStatus::Running, "so its end was not written either");
    }
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn postgres_compresses_a_fast_runs_chunks_and_its_long_answer_with_lz4_where_it_can() {
    let (store, db) = open(Backend::Postgres).await;
    let c = conversation("ann", "fast");
    let start = run_start(&c, true);
    assert_eq!(store.start_run(&start).await.unwrap(), StartOutcome::Started);
    let trace_id = start.traces[0].trace_id;
    // One flush of a fast stream: 1,000 events, tens of KB in one chunk.
    let events = text_deltas(trace_id, 1..=1000);
    store.append_events(&events, &[]).await.unwrap();
    let read = store.trace_events(trace_id, 0).await.unwrap();
    assert_eq!(read.len(), 1000);
    assert_eq!(json(&read[999])["text"], "t1000");
    // An answer long enough to be compressed (past 2 KB), as prose is.
    let text: String = (1..=1500).map(|n| format!("word{} ", n * 7919 % 1000)).collect();
    let mut answer = Message::new(c.id, Some(start.user_message.id), Role::Assistant, text.clone());
    answer.id = start.traces[0].message_id;
    store.finish_run(&ended(&start.traces[0], Some(answer))).await.unwrap();

    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let lz4 = sqlx::query("create temp table lz4_here (x text compression lz4)").execute(&pool).await.is_ok();
    let (method,): (Option<String>,) =
        sqlx::query_as("select pg_column_compression(events) from trace_event_chunks").fetch_one(&pool).await.unwrap();
    let (answer_method, stored): (Option<String>, String) =
        sqlx::query_as("select pg_column_compression(content), content from messages where role = 'assistant'")
            .fetch_one(&pool)
            .await
            .unwrap();
    pool.close().await;
    let expected = if lz4 { "lz4" } else { "pglz" };
    assert_eq!(method.as_deref(), Some(expected), "a server with lz4 compresses the log's chunks with it");
    assert_eq!(answer_method.as_deref(), Some(expected), "and the answers' text");
    assert_eq!(stored, text, "which reads back as it was written");
}

/// A batch of the log is checked against its runs' traces as a set in whichever plan Postgres
/// keeps for its statement. The generic plan (what a prepared statement runs from its sixth
/// time on, where it costs no more than a custom one) had scanned the traces with a filter
/// `id = any($1)`, each trace compared with each id of the batch: while the table is small
/// enough to scan, a million comparisons a flush at 1,000 running runs.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn postgres_checks_a_log_batch_against_its_traces_as_a_set_in_any_plan() {
    use sqlx::{Connection, Row};
    let (store, db) = open(Backend::Postgres).await;
    let starts: Vec<RunStart> = (0..300).map(|n| run_start(&conversation("ann", &format!("c{n}")), true)).collect();
    assert_eq!(store.start_runs(&starts.iter().collect::<Vec<_>>()).await.unwrap(), StartOutcome::Started);
    let ids: Vec<String> = starts.iter().map(|s| s.traces[0].trace_id.to_string()).collect();

    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let prepare = format!(
        "set plan_cache_mode = force_generic_plan; prepare batch (uuid[], int8[], int8[], text[]) as {}",
        chatd::store::PostgresStore::INSERT_CHUNKS
    );
    sqlx::raw_sql(&prepare).execute(&mut conn).await.unwrap();
    let (seqs, events) = (vec!["1"; ids.len()].join(","), vec![r#""[]""#; ids.len()].join(","));
    let explain = format!(
        "explain (analyze, costs off) execute batch('{{{}}}', '{{{seqs}}}', '{{{seqs}}}', '{{{events}}}')",
        ids.join(",")
    );
    let plan: Vec<String> =
        sqlx::raw_sql(&explain).fetch_all(&mut conn).await.unwrap().iter().map(|row| row.get(0)).collect();
    let plan = plan.join("\n");
    assert!(
        !plan.lines().any(|line| line.contains("Filter:") && line.contains("ANY")),
        "no trace is compared with each id of the batch:\n{plan}"
    );
    let (written,): (i64,) =
        sqlx::query_as("select count(*) from trace_event_chunks").fetch_one(&mut conn).await.unwrap();
    assert_eq!(written, 300, "a chunk for each run: {plan}");
}

/// Notices told together reach another process each as its own, in their order (one
/// statement, one notification each: a process of the version before reads them as it did).
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn postgres_tells_notices_told_together_each_in_its_order() {
    use chatd::ids::ConversationId;
    use chatd::store::Notice;
    use futures_util::StreamExt;
    let (here, db) = open(Backend::Postgres).await;
    let there = store::connect(&db.url, 2).await.unwrap();
    let mut heard = there.notices().await.unwrap().expect("Postgres has other processes");
    let (c, t) = (ConversationId::new(), TraceId::new());
    let told = [Notice::Started(c, t), Notice::Cancel(t), Notice::Missed, Notice::Logged(t), Notice::Deleted(c)];
    here.notify(&told).await.unwrap();
    let mut got = Vec::new();
    while got.len() < 4 {
        let notice = tokio::time::timeout(std::time::Duration::from_secs(10), heard.next()).await.unwrap().unwrap();
        got.push(notice);
    }
    assert_eq!(got, [Notice::Started(c, t), Notice::Cancel(t), Notice::Logged(t), Notice::Deleted(c)]);
    here.notify(&[]).await.unwrap();
}

/// An end whose caller stops waiting for its turn (its future dropped: its run handed
/// over, say) is not written later by another end that takes the ends waiting (Postgres,
/// where ends go together).
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn postgres_writes_no_end_dropped_while_it_waits() {
    let (store, db) = open(Backend::Postgres).await;
    let ann = user("ann");
    let records: Vec<RunFinish> = new_chats(&store, 3).await.iter().map(answered).collect();
    // The first end takes the turn, and its statement waits for a lock held on its trace;
    // the second waits for the turn, and is dropped.
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let mut lock = pool.begin().await.unwrap();
    sqlx::query("select 1 from traces where id = $1 for update")
        .bind(records[0].trace_id.0)
        .execute(&mut *lock)
        .await
        .unwrap();
    let first = store.finish_run(&records[0]);
    tokio::pin!(first);
    assert!(futures_util::poll!(&mut first).is_pending());
    {
        let second = store.finish_run(&records[1]);
        tokio::pin!(second);
        assert!(futures_util::poll!(&mut second).is_pending());
    }
    lock.rollback().await.unwrap();
    first.await.unwrap();
    store.finish_run(&records[2]).await.unwrap();
    let dropped = store.get_trace(&ann, records[1].trace_id).await.unwrap();
    assert_eq!(dropped.status, TraceStatus::Running, "the dropped end was not written");
    assert_eq!(store.get_trace(&ann, records[2].trace_id).await.unwrap().status, TraceStatus::Completed);
}

/// An end taken into another's statement, whose taker is dropped after its statement went to
/// the server (its run's task cancelled mid-write, by a hand-over that came as the run began
/// its end), writes itself again on its own; where the statement had committed, it finds its
/// run ended by its own record and hears that it was written, not that its answer could not
/// be saved. (So does an end tried again after its first try was written.)
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn postgres_tells_an_end_written_by_a_statement_whose_taker_was_dropped() {
    use sqlx::Connection;
    let (store, db) = open(Backend::Postgres).await;
    let ann = user("ann");
    let starts = new_chats(&store, 4).await;
    let mut records: Vec<RunFinish> = starts.iter().map(answered).collect();
    // The fourth has no answer: it goes alone, and holds the one turn for ends alone (a
    // pool of 4) while a lock holds its statement.
    records[3] = ended(&starts[3].traces[0], None);
    let locks = sqlx::PgPool::connect(&db.url).await.unwrap();
    let lock = async |n: usize| {
        let mut tx = locks.begin().await.unwrap();
        sqlx::query("select 1 from traces where id = $1 for update")
            .bind(records[n].trace_id.0)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx
    };
    let (held_first, held_third, held_fourth) = (lock(0).await, lock(2).await, lock(3).await);
    let mut watcher = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut waiting = async |n: usize| {
        for _ in 0..500 {
            let queries: Vec<String> = sqlx::query_scalar(
                "select query from pg_stat_activity where wait_event_type = 'Lock' and datname = current_database()",
            )
            .fetch_all(&mut watcher)
            .await
            .unwrap();
            if queries.len() == n {
                return queries;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("{n} statements never waited for a lock");
    };
    let end = |n: usize| {
        let (store, record) = (store.clone(), records[n].clone());
        Box::pin(async move { store.finish_run(&record).await })
    };
    let fourth = tokio::spawn(end(3));
    waiting(1).await;
    // The first takes the turn for ends that go together, and writes alone (none waits).
    let first = tokio::spawn(end(0));
    waiting(2).await;
    // The second and third wait for that turn, in that order.
    let (mut second, mut third) = (end(1), end(2));
    assert!(futures_util::poll!(&mut second).is_pending());
    assert!(futures_util::poll!(&mut third).is_pending());
    let (second, third) = (tokio::spawn(second), tokio::spawn(third));
    held_first.rollback().await.unwrap();
    first.await.unwrap().unwrap();
    // The second gets the turn, takes the third, and their statement waits for the third's
    // trace; the second is dropped there.
    let queries = waiting(2).await;
    assert!(queries.iter().any(|q| q.starts_with("with v as")), "the two ends' statement waits: {queries:?}");
    second.abort();
    assert!(second.await.unwrap_err().is_cancelled());
    held_third.rollback().await.unwrap();
    let mut tries = 0;
    while store.get_trace(&ann, records[1].trace_id).await.unwrap().status != TraceStatus::Completed {
        tries += 1;
        assert!(tries < 500, "the dropped taker's statement committed");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(store.get_trace(&ann, records[2].trace_id).await.unwrap().status, TraceStatus::Completed);
    // The third, told nothing, writes itself alone once the fourth has written: its run has
    // ended, by its own record.
    held_fourth.rollback().await.unwrap();
    fourth.await.unwrap().unwrap();
    third.await.unwrap().expect("the end written by the dropped taker's statement is told it was written");
    let conversation = store.get_conversation(&ann, starts[2].user_message.conversation_id).await.unwrap();
    assert_eq!(conversation.message_count, 2, "its answer was written once");
    assert_eq!(conversation.active_leaf_id, Some(records[2].assistant_message.as_ref().unwrap().id));
}

/// Each run of a log batch is told to other processes as the batch commits: chunks alone
/// (one statement), chunks with a checkpoint (a transaction), and a batch written again
/// past a chunk written already (its new chunk's run only: notices come in the order of
/// their commits, and the next one heard is one told after it).
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn postgres_tells_each_run_of_a_log_batch_as_it_commits() {
    use chatd::store::{Notice, Progress};
    use futures_util::StreamExt;
    let (here, db) = open(Backend::Postgres).await;
    let there = store::connect(&db.url, 2).await.unwrap();
    let mut heard = there.notices().await.unwrap().expect("Postgres has other processes");
    let starts: Vec<RunStart> = (0..3).map(|n| run_start(&conversation("ann", &format!("c{n}")), true)).collect();
    assert_eq!(here.start_runs(&starts.iter().collect::<Vec<_>>()).await.unwrap(), StartOutcome::Started);
    let ids: Vec<TraceId> = starts.iter().map(|s| s.traces[0].trace_id).collect();
    let mut hear = async |runs: &[TraceId]| {
        let mut got = Vec::new();
        while got.len() < runs.len() {
            got.push(tokio::time::timeout(std::time::Duration::from_secs(10), heard.next()).await.unwrap().unwrap());
        }
        for id in runs {
            assert!(got.contains(&Notice::Logged(*id)), "{id} is told: {got:?}");
        }
    };
    here.append_events(&[text_deltas(ids[0], 1..=2), text_deltas(ids[1], 1..=1)].concat(), &[]).await.unwrap();
    hear(&ids[..2]).await;
    let checkpoint = Progress::of(ids[0], &json!({"step": 1}));
    here.append_events(&text_deltas(ids[2], 1..=1), &[checkpoint]).await.unwrap();
    hear(&ids[2..]).await;
    here.append_events(&[text_deltas(ids[2], 1..=1), text_deltas(ids[1], 2..=2)].concat(), &[]).await.unwrap();
    hear(&ids[1..2]).await;
    // Nothing else was told: the chunk written before was told by its own commit.
    let sentinel = TraceId::new();
    here.notify(&[Notice::Logged(sentinel)]).await.unwrap();
    hear(&[sentinel]).await;
    assert_eq!(here.trace_events(ids[1], 0).await.unwrap().len(), 2, "the batch written again wrote its new chunk");
    assert_eq!(here.trace_events(ids[2], 0).await.unwrap().len(), 1, "and not the one written already");
}

/// Connections of the pool cut while they sat idle (a restart, a failover, a firewall) are
/// found by the ping before use and replaced: the writes and reads after go through.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn postgres_replaces_connections_cut_while_they_sat_idle() {
    let (store, db) = open(Backend::Postgres).await;
    let first = conversation("ann", "before the cut");
    assert_eq!(store.start_run(&run_start(&first, true)).await.unwrap(), StartOutcome::Started);
    let name = db.url.rsplit('/').next().unwrap().split('?').next().unwrap().to_owned();
    let admin = sqlx::PgPool::connect(&std::env::var("CHATD_TEST_POSTGRES_URL").unwrap()).await.unwrap();
    let (cut,): (i64,) = sqlx::query_as(
        "select count(pg_terminate_backend(pid)) from pg_stat_activity where datname = $1 and pid <> pg_backend_pid()",
    )
    .bind(&name)
    .fetch_one(&admin)
    .await
    .unwrap();
    admin.close().await;
    assert!(cut > 0, "the store's connections were cut");
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let second = conversation("ann", "after the cut");
    assert_eq!(store.start_run(&run_start(&second, true)).await.unwrap(), StartOutcome::Started);
    assert_eq!(store.get_conversation(&user("ann"), first.id).await.unwrap().title, "before the cut");
}
