//! The SQL both backends share. SQLite and Postgres accept the same statements here (`$n`
//! parameters, `returning`, `on conflict`), and the row types in `rows.rs` decode on both, so
//! the [`Store`](super::Store) methods are written once and expanded per backend by
//! `impl_store!`. A backend keeps only what is its own (connecting, migrations) in its file.

/// Rows in one multi-row insert, at most: 21 parameters a message row stays well under
/// SQLite's 32,766 and Postgres's 65,535 parameters a statement.
pub const ROWS_PER_INSERT: usize = 500;

/// Implements `Store` for `$store` (a struct with a `pool: sqlx::Pool<$db>` field for reads and
/// an async `write(f)` that runs `f` on a connection to write on).
macro_rules! impl_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::Store for $store {
            fn is_shared(&self) -> bool {
                <Self as $crate::store::Shared>::SHARED
            }

            async fn ping(&self) -> Result<(), StoreError> {
                self.ping_impl().await
            }

            async fn create_conversation(&self, c: &Conversation) -> Result<(), StoreError> {
                self.write(async |conn| Self::insert_conversation(conn, c).await).await
            }

            async fn list_conversations(
                &self,
                user: &UserId,
                limit: u32,
                cursor: Option<PageCursor>,
            ) -> Result<Vec<Conversation>, StoreError> {
                let rows: Vec<ConversationRow> = match cursor {
                    None => {
                        let sql = format!(
                            "select {CONVERSATION_COLUMNS} from conversations where user_id = $1 \
                             order by last_message_at desc, id desc limit $2"
                        );
                        sqlx::query_as(&sql).bind(user).bind(i64::from(limit)).fetch_all(&self.pool).await?
                    }
                    Some(cursor) => {
                        let sql = format!(
                            "select {CONVERSATION_COLUMNS} from conversations where user_id = $1 \
                             and (last_message_at < $2 or (last_message_at = $2 and id < $3)) \
                             order by last_message_at desc, id desc limit $4"
                        );
                        sqlx::query_as(&sql)
                            .bind(user)
                            .bind(cursor.last_message_at)
                            .bind(cursor.id)
                            .bind(i64::from(limit))
                            .fetch_all(&self.pool)
                            .await?
                    }
                };
                Ok(rows.into_iter().map(Conversation::from).collect())
            }

            async fn get_conversation(&self, user: &UserId, id: ConversationId) -> Result<Conversation, StoreError> {
                let sql = format!(
                    "select {CONVERSATION_COLUMNS} from conversations where id = $1 and user_id = $2"
                );
                let row: Option<ConversationRow> =
                    sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(&self.pool).await?;
                row.map(Conversation::from).ok_or(StoreError::NotFound)
            }

            async fn update_conversation(
                &self,
                user: &UserId,
                id: ConversationId,
                patch: &ConversationPatch,
            ) -> Result<Conversation, StoreError> {
                let sql = format!(
                    "update conversations set title = coalesce($3, title), \
                     profile = coalesce($4, profile), system_prompt = coalesce($5, system_prompt), \
                     metadata = coalesce($6, metadata), updated_at = $7 \
                     where id = $1 and user_id = $2 returning {CONVERSATION_COLUMNS}"
                );
                let row: Option<ConversationRow> = self
                    .write(async |conn| {
                        Ok(sqlx::query_as(&sql)
                            .bind(id)
                            .bind(user)
                            .bind(patch.title.as_deref())
                            .bind(patch.profile.as_deref())
                            .bind(patch.system_prompt.as_deref())
                            .bind(patch.metadata.as_ref().map(Json))
                            .bind(now())
                            .fetch_optional(conn)
                            .await?)
                    })
                    .await?;
                row.map(Conversation::from).ok_or(StoreError::NotFound)
            }

            async fn delete_conversation(&self, user: &UserId, id: ConversationId) -> Result<(), StoreError> {
                let done = self
                    .write(async |conn| {
                        Ok(sqlx::query("delete from conversations where id = $1 and user_id = $2")
                            .bind(id)
                            .bind(user)
                            .execute(conn)
                            .await?)
                    })
                    .await?;
                if done.rows_affected() == 0 {
                    return Err(StoreError::NotFound);
                }
                Ok(())
            }

            async fn messages(&self, user: &UserId, conversation_id: ConversationId) -> Result<Vec<Message>, StoreError> {
                let sql = format!(
                    "select {MESSAGE_COLUMNS} from messages where conversation_id = $1 and user_id = $2 \
                     order by created_at, id"
                );
                let rows: Vec<MessageRow> =
                    sqlx::query_as(&sql).bind(conversation_id).bind(user).fetch_all(&self.pool).await?;
                rows.into_iter().map(Message::try_from).collect()
            }

            async fn set_feedback(
                &self,
                user: &UserId,
                message_id: MessageId,
                feedback: Option<Feedback>,
            ) -> Result<Message, StoreError> {
                let sql = format!(
                    "update messages set feedback = $3 where id = $1 and user_id = $2 \
                     returning {MESSAGE_COLUMNS}"
                );
                let row: Option<MessageRow> = self
                    .write(async |conn| {
                        Ok(sqlx::query_as(&sql)
                            .bind(message_id)
                            .bind(user)
                            .bind(feedback.as_ref().map(Json))
                            .fetch_optional(conn)
                            .await?)
                    })
                    .await?;
                row.ok_or(StoreError::NotFound)?.try_into()
            }

            async fn start_runs(&self, starts: &[&RunStart]) -> Result<(), StoreError> {
                // A few statements for any number of starts: new conversations, messages and
                // traces go in as one multi-row insert each (a statement is a round trip to
                // the database, and these come in bursts). A new conversation is inserted as
                // it stands after its first message; an existing one is updated per message.
                let mut conversations = Vec::new();
                let mut messages = Vec::new();
                let mut traces = Vec::new();
                for start in starts {
                    let first = start.traces.first().ok_or(StoreError::Conflict("a run needs a trace".into()))?;
                    if let Some(c) = &start.new_conversation {
                        let mut c = c.clone();
                        if start.user_message_is_new {
                            let m = &start.user_message;
                            c.active_leaf_id = Some(m.id);
                            c.message_count += 1;
                            (c.last_message_at, c.updated_at) = (m.created_at, m.created_at);
                        }
                        conversations.push(c);
                    }
                    if start.user_message_is_new {
                        messages.push((&first.user_id, &start.user_message));
                    }
                    traces.extend(start.traces.iter().map(|t| (t, start.replica_id.as_str())));
                }
                if <Self as $crate::store::Shared>::MANY_STATEMENTS_PER_QUERY {
                    return self.start_runs_in_one_query(&conversations, &messages, starts, &traces).await;
                }
                self.write(async |conn| {
                    let mut tx = sqlx::Connection::begin_with(conn, <Self as $crate::store::Shared>::BEGIN_WRITE).await?;
                    if <Self as $crate::store::Shared>::SHARED {
                        Self::check_running_limits(&mut *tx, starts).await?;
                    }
                    for rows in conversations.chunks($crate::store::sql::ROWS_PER_INSERT) {
                        Self::insert_conversations(&mut *tx, rows).await?;
                    }
                    for rows in messages.chunks($crate::store::sql::ROWS_PER_INSERT) {
                        Self::insert_messages(&mut *tx, rows).await?;
                    }
                    for start in starts {
                        if start.user_message_is_new && start.new_conversation.is_none() {
                            let user = &start.traces[0].user_id;
                            Self::touch_conversation(&mut *tx, user, &start.user_message).await?;
                        }
                        if let Some(c) = &start.comparison {
                            let mut query = sqlx::QueryBuilder::<$db>::new("");
                            Self::push_comparison(&mut query, c);
                            query.build().execute(&mut *tx).await?;
                        }
                    }
                    for rows in traces.chunks($crate::store::sql::ROWS_PER_INSERT) {
                        let mut query = sqlx::QueryBuilder::<$db>::new("");
                        Self::push_traces(&mut query, rows);
                        query.build().execute(&mut *tx).await?;
                    }
                    tx.commit().await?;
                    Ok(())
                })
                .await
            }

            async fn append_events(&self, events: &[NewEvent]) -> Result<(), StoreError> {
                self.append_events_impl(events).await
            }

            async fn finish_run(&self, finish: &RunFinish) -> Result<(), StoreError> {
                self.write(async |conn| {
                    let mut tx = sqlx::Connection::begin_with(conn, <Self as $crate::store::Shared>::BEGIN_WRITE).await?;
                    // Only a running trace ends: if another process already closed it (marked it
                    // interrupted), this result is refused whole instead of overwriting that.
                    let owner: Option<(UserId,)> = sqlx::query_as(
                        "update traces set status = $2, ended_at = $3, usage = $4, error = $5, spans = $6 \
                         where id = $1 and status = 'running' returning user_id",
                    )
                    .bind(finish.trace_id)
                    .bind(finish.status.as_str())
                    .bind(finish.ended_at)
                    .bind(Json(&finish.usage))
                    .bind(finish.error.as_ref().map(Json))
                    .bind(Json(&finish.spans))
                    .fetch_optional(&mut *tx)
                    .await?;
                    let Some((user,)) = owner else {
                        return Err(StoreError::Conflict("the run has already ended".into()));
                    };
                    if let Some(message) = &finish.assistant_message {
                        Self::append_message(&mut *tx, &user, message).await?;
                    }
                    tx.commit().await?;
                    Ok(())
                })
                .await
            }

            async fn get_trace(&self, user: &UserId, trace_id: TraceId) -> Result<Trace, StoreError> {
                let sql = format!("select {TRACE_COLUMNS} from traces where id = $1 and user_id = $2");
                let row: Option<TraceRow> =
                    sqlx::query_as(&sql).bind(trace_id).bind(user).fetch_optional(&self.pool).await?;
                row.ok_or(StoreError::NotFound)?.try_into()
            }

            async fn trace_by_message(&self, user: &UserId, message_id: MessageId) -> Result<Trace, StoreError> {
                let sql = format!(
                    "select {TRACE_COLUMNS} from traces where message_id = $1 and user_id = $2 \
                     order by started_at desc limit 1"
                );
                let row: Option<TraceRow> =
                    sqlx::query_as(&sql).bind(message_id).bind(user).fetch_optional(&self.pool).await?;
                row.ok_or(StoreError::NotFound)?.try_into()
            }

            async fn get_message(&self, user: &UserId, id: MessageId) -> Result<Message, StoreError> {
                let sql = format!("select {MESSAGE_COLUMNS} from messages where id = $1 and user_id = $2");
                let row: Option<MessageRow> = sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(&self.pool).await?;
                row.ok_or(StoreError::NotFound)?.try_into()
            }

            async fn set_active_leaf(&self, user: &UserId, conversation_id: ConversationId, leaf: MessageId) -> Result<(), StoreError> {
                let done = self
                    .write(async |conn| {
                        Ok(sqlx::query(
                            "update conversations set active_leaf_id = $3, updated_at = $4 where id = $1 and user_id = $2 \
                             and exists (select 1 from messages where id = $3 and conversation_id = $1)",
                        )
                        .bind(conversation_id)
                        .bind(user)
                        .bind(leaf)
                        .bind(now())
                        .execute(conn)
                        .await?)
                    })
                    .await?;
                if done.rows_affected() == 0 {
                    return Err(StoreError::NotFound);
                }
                Ok(())
            }

            async fn get_comparison(&self, user: &UserId, id: ComparisonId) -> Result<Comparison, StoreError> {
                let sql = format!("select {COMPARISON_COLUMNS} from comparisons where id = $1 and user_id = $2");
                let row: Option<ComparisonRow> =
                    sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(&self.pool).await?;
                row.ok_or(StoreError::NotFound)?.try_into()
            }

            async fn vote(
                &self,
                user: &UserId,
                id: ComparisonId,
                preference: Preference,
                change: bool,
            ) -> Result<Comparison, StoreError> {
                self.write(async |conn| {
                    let mut tx = sqlx::Connection::begin_with(conn, <Self as $crate::store::Shared>::BEGIN_WRITE).await?;
                    let sql = format!("select {COMPARISON_COLUMNS} from comparisons where id = $1 and user_id = $2");
                    let row: Option<ComparisonRow> =
                        sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(&mut *tx).await?;
                    let mut comparison: Comparison = row.ok_or(StoreError::NotFound)?.try_into()?;
                    match comparison.preference {
                        Some(current) if current == preference => return Ok(comparison),
                        Some(_) if !change => {
                            return Err(StoreError::Conflict("This comparison has another vote; change it with PUT".into()));
                        }
                        _ => {}
                    }
                    let at = now();
                    comparison.preference = Some(preference);
                    comparison.voted_at = Some(at);
                    comparison.vote_history.push(Vote { preference, at });
                    sqlx::query("update comparisons set preference = $2, voted_at = $3, vote_history = $4 where id = $1")
                        .bind(id)
                        .bind(preference.as_str())
                        .bind(at)
                        .bind(Json(&comparison.vote_history))
                        .execute(&mut *tx)
                        .await?;
                    // The preferred answer (A for a tie or both bad) becomes the active branch.
                    let trace = if preference == Preference::B { comparison.trace_b } else { comparison.trace_a };
                    sqlx::query(
                        "update conversations set active_leaf_id = (select message_id from traces where id = $2) \
                         where id = $1 and exists (select 1 from messages where id = (select message_id from traces where id = $2))",
                    )
                    .bind(comparison.conversation_id)
                    .bind(trace)
                    .execute(&mut *tx)
                    .await?;
                    tx.commit().await?;
                    Ok(comparison)
                })
                .await
            }

            async fn voted_comparisons(&self) -> Result<Vec<Comparison>, StoreError> {
                let sql = format!(
                    "select {COMPARISON_COLUMNS} from comparisons where voted_at is not null order by voted_at, id"
                );
                let rows: Vec<ComparisonRow> = sqlx::query_as(&sql).fetch_all(&self.pool).await?;
                rows.into_iter().map(Comparison::try_from).collect()
            }

            async fn context_state(&self, user: &UserId, conversation_id: ConversationId) -> Result<Option<ContextState>, StoreError> {
                let row: Option<(Json<Value>,)> =
                    sqlx::query_as("select state from context_states where conversation_id = $1 and user_id = $2")
                        .bind(conversation_id)
                        .bind(user)
                        .fetch_optional(&self.pool)
                        .await?;
                Ok(row.and_then(|(state,)| $crate::store::rows::context_state(state.0)))
            }

            async fn set_context_state(
                &self,
                user: &UserId,
                conversation_id: ConversationId,
                state: Option<&ContextState>,
            ) -> Result<(), StoreError> {
                self.write(async |conn| {
                match state {
                    Some(state) => {
                        let strategy = state.strategy.as_str();
                        sqlx::query(
                            "insert into context_states (conversation_id, user_id, strategy, state, updated_at) \
                             values ($1, $2, $3, $4, $5) on conflict (conversation_id) do update \
                             set strategy = excluded.strategy, state = excluded.state, updated_at = excluded.updated_at",
                        )
                        .bind(conversation_id)
                        .bind(user)
                        .bind(strategy)
                        .bind(Json(state))
                        .bind(now())
                        .execute(&mut *conn)
                        .await?;
                    }
                    None => {
                        sqlx::query("delete from context_states where conversation_id = $1 and user_id = $2")
                            .bind(conversation_id)
                            .bind(user)
                            .execute(&mut *conn)
                            .await?;
                    }
                }
                Ok(())
                })
                .await
            }

            async fn running_traces(&self) -> Result<Vec<RunningTrace>, StoreError> {
                let sql = format!(
                    "select {TRACE_COLUMNS}, replica_id, heartbeat_at from traces where status = 'running'"
                );
                let rows: Vec<RunningRow> = sqlx::query_as(&sql).fetch_all(&self.pool).await?;
                rows.into_iter().map(RunningTrace::try_from).collect()
            }

            async fn heartbeat(&self, replica_id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
                self.write(async |conn| {
                    sqlx::query("update traces set heartbeat_at = $2 where replica_id = $1 and status = 'running'")
                        .bind(replica_id)
                        .bind(at)
                        .execute(conn)
                        .await?;
                    Ok(())
                })
                .await
            }

            async fn notify(&self, notice: Notice) -> Result<(), StoreError> {
                self.notify_impl(notice).await
            }

            async fn notices(&self) -> Result<Option<BoxStream<'static, Notice>>, StoreError> {
                self.notices_impl().await
            }

            async fn trace_events(&self, trace_id: TraceId, after: i64) -> Result<Vec<LoggedEvent>, StoreError> {
                self.trace_events_impl(trace_id, after).await
            }

            async fn seal_logs(&self, traces: &[TraceId]) -> Result<(), StoreError> {
                self.seal_logs_impl(traces).await
            }
        }

        impl $store {
            /// Counts each user's running runs, with the starts' new ones, against the starts'
            /// `max_running`, holding a lock per user until the transaction ends: replicas
            /// that start runs for one user at once take turns here, and each sees the runs
            /// the others committed.
            async fn check_running_limits(
                conn: &mut <$db as sqlx::Database>::Connection,
                starts: &[&RunStart],
            ) -> Result<(), StoreError> {
                let mut users: Vec<(&UserId, usize, usize)> = Vec::new();
                for start in starts {
                    let (Some(limit), Some(first)) = (start.max_running, start.traces.first()) else { continue };
                    match users.iter_mut().find(|(user, _, _)| *user == &first.user_id) {
                        Some((_, _, adding)) => *adding += start.traces.len(),
                        None => users.push((&first.user_id, limit, start.traces.len())),
                    }
                }
                users.sort_unstable();
                for (user, limit, adding) in users {
                    sqlx::query("select pg_advisory_xact_lock(hashtextextended($1, 7))").bind(user).execute(&mut *conn).await?;
                    let (running,): (i64,) =
                        sqlx::query_as("select count(*) from traces where user_id = $1 and status = 'running'")
                            .bind(user)
                            .fetch_one(&mut *conn)
                            .await?;
                    let running = usize::try_from(running).unwrap_or(usize::MAX);
                    if running + adding > limit {
                        return Err(StoreError::TooManyRuns(running));
                    }
                }
                Ok(())
            }

            async fn insert_conversation(
                conn: &mut <$db as sqlx::Database>::Connection,
                c: &Conversation,
            ) -> Result<(), StoreError> {
                Self::insert_conversations(conn, std::slice::from_ref(c)).await
            }

            async fn insert_conversations(
                conn: &mut <$db as sqlx::Database>::Connection,
                rows: &[Conversation],
            ) -> Result<(), StoreError> {
                let mut query = sqlx::QueryBuilder::<$db>::new("");
                Self::push_conversations(&mut query, rows);
                query.build().execute(&mut *conn).await?;
                Ok(())
            }

            fn push_conversations<'a>(query: &mut sqlx::QueryBuilder<'a, $db>, rows: &'a [Conversation]) {
                query.push(
                    "insert into conversations (id, user_id, title, profile, system_prompt, metadata, \
                     active_leaf_id, message_count, created_at, updated_at, last_message_at) ",
                );
                query.push_values(rows, |mut row, c| {
                    row.push_bind(c.id)
                        .push_bind(&c.user_id)
                        .push_bind(&c.title)
                        .push_bind(c.profile.as_deref())
                        .push_bind(c.system_prompt.as_deref())
                        .push_bind(Json(&c.metadata))
                        .push_bind(c.active_leaf_id)
                        .push_bind(c.message_count)
                        .push_bind(c.created_at)
                        .push_bind(c.updated_at)
                        .push_bind(c.last_message_at);
                });
            }

            /// Inserts messages, each `(owner, message)`, without touching their conversations.
            async fn insert_messages(
                conn: &mut <$db as sqlx::Database>::Connection,
                rows: &[(&UserId, &Message)],
            ) -> Result<(), StoreError> {
                let mut query = sqlx::QueryBuilder::<$db>::new("");
                Self::push_messages(&mut query, rows);
                query.build().execute(&mut *conn).await?;
                Ok(())
            }

            fn push_messages<'a>(query: &mut sqlx::QueryBuilder<'a, $db>, rows: &'a [(&'a UserId, &'a Message)]) {
                query.push(
                    "insert into messages (id, conversation_id, user_id, parent_id, role, content, \
                     thinking, provider_state, tool_calls, tool_history, payloads, suggested_values, \
                     suggested_actions, cancelled, model, trace_id, usage, feedback, comparison_id, \
                     variant, created_at) ",
                );
                query.push_values(rows, |mut row, (user, m)| {
                    row.push_bind(m.id)
                        .push_bind(m.conversation_id)
                        .push_bind(*user)
                        .push_bind(m.parent_id)
                        .push_bind(m.role.as_str())
                        .push_bind(&m.content)
                        .push_bind(m.thinking.as_deref())
                        .push_bind($crate::store::rows::provider_state(m))
                        .push_bind(Json(&m.tool_calls))
                        .push_bind(Json(&m.tool_history))
                        .push_bind(Json(&m.payloads))
                        .push_bind(Json(&m.suggested_values))
                        .push_bind(Json(&m.suggested_actions))
                        .push_bind(m.cancelled)
                        .push_bind(m.model.as_deref())
                        .push_bind(m.trace_id)
                        .push_bind(m.usage.as_ref().map(Json))
                        .push_bind(m.feedback.as_ref().map(Json))
                        .push_bind(m.comparison_id)
                        .push_bind(m.variant.as_deref())
                        .push_bind(m.created_at);
                });
            }

            fn push_comparison<'a>(query: &mut sqlx::QueryBuilder<'a, $db>, c: &'a Comparison) {
                query.push(
                    "insert into comparisons (id, conversation_id, user_id, user_message_id, trace_a, trace_b, \
                     profile_a, profile_b, model_a, model_b, created_at) ",
                );
                query.push_values([c], |mut row, c| {
                    row.push_bind(c.comparison_id)
                        .push_bind(c.conversation_id)
                        .push_bind(&c.user_id)
                        .push_bind(c.user_message_id)
                        .push_bind(c.trace_a)
                        .push_bind(c.trace_b)
                        .push_bind(&c.profile_a)
                        .push_bind(&c.profile_b)
                        .push_bind(&c.model_a)
                        .push_bind(&c.model_b)
                        .push_bind(c.created_at);
                });
            }

            fn push_traces<'a>(query: &mut sqlx::QueryBuilder<'a, $db>, rows: &'a [(&'a Trace, &'a str)]) {
                query.push(
                    "insert into traces (id, conversation_id, user_id, user_message_id, message_id, status, \
                     model, profile, started_at, spans, comparison_id, variant, replica_id, heartbeat_at) ",
                );
                query.push_values(rows, |mut row, (t, replica_id)| {
                    row.push_bind(t.trace_id)
                        .push_bind(t.conversation_id)
                        .push_bind(&t.user_id)
                        .push_bind(t.user_message_id)
                        .push_bind(t.message_id)
                        .push_bind(t.status.as_str())
                        .push_bind(&t.model)
                        .push_bind(&t.profile)
                        .push_bind(t.started_at)
                        .push_bind(Json(&t.spans))
                        .push_bind(t.comparison_id)
                        .push_bind(t.variant.as_deref())
                        .push_bind(*replica_id)
                        .push_bind(t.started_at);
                });
            }

            /// The whole group of starts as one query of several statements, the transaction
            /// included: one round trip to the database instead of one per statement (SQLite
            /// runs each on its own thread; under load, every trip back waited its turn on a
            /// busy runtime). A conversation deleted meanwhile fails its message's or trace's
            /// foreign key, and reads as not found, as a conversation that no update touched
            /// does on the other path.
            async fn start_runs_in_one_query(
                &self,
                conversations: &[Conversation],
                messages: &[(&UserId, &Message)],
                starts: &[&RunStart],
                traces: &[(&Trace, &str)],
            ) -> Result<(), StoreError> {
                let mut query = sqlx::QueryBuilder::<$db>::new(<Self as $crate::store::Shared>::BEGIN_WRITE);
                for rows in conversations.chunks($crate::store::sql::ROWS_PER_INSERT) {
                    query.push("; ");
                    Self::push_conversations(&mut query, rows);
                }
                for rows in messages.chunks($crate::store::sql::ROWS_PER_INSERT) {
                    query.push("; ");
                    Self::push_messages(&mut query, rows);
                }
                for start in starts {
                    if start.user_message_is_new && start.new_conversation.is_none() {
                        query.push("; ");
                        Self::push_touch(&mut query, &start.traces[0].user_id, &start.user_message);
                    }
                    if let Some(c) = &start.comparison {
                        query.push("; ");
                        Self::push_comparison(&mut query, c);
                    }
                }
                for rows in traces.chunks($crate::store::sql::ROWS_PER_INSERT) {
                    query.push("; ");
                    Self::push_traces(&mut query, rows);
                }
                query.push("; COMMIT");
                self.write(async |conn| {
                    Self::transaction_as_one_query(conn, query).await.map_err(|e| match e.as_database_error() {
                        Some(db) if db.is_foreign_key_violation() => StoreError::NotFound,
                        _ => e.into(),
                    })
                })
                .await
            }

            /// Runs `query`, a whole transaction (`BEGIN …; …; COMMIT`) sent as one query, on
            /// `conn`; when a statement fails, the statements stop there and the transaction
            /// they began is rolled back.
            async fn transaction_as_one_query(
                conn: &mut <$db as sqlx::Database>::Connection,
                mut query: sqlx::QueryBuilder<'_, $db>,
            ) -> Result<(), sqlx::Error> {
                if let Err(e) = query.build().execute(&mut *conn).await {
                    let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
                    return Err(e);
                }
                Ok(())
            }

            /// Inserts a message and makes it the conversation's active leaf.
            async fn append_message(
                conn: &mut <$db as sqlx::Database>::Connection,
                user: &UserId,
                m: &Message,
            ) -> Result<(), StoreError> {
                Self::insert_messages(conn, &[(user, m)]).await?;
                Self::touch_conversation(conn, user, m).await
            }

            /// Counts a new message in its conversation and makes it the active leaf.
            async fn touch_conversation(
                conn: &mut <$db as sqlx::Database>::Connection,
                user: &UserId,
                m: &Message,
            ) -> Result<(), StoreError> {
                let mut query = sqlx::QueryBuilder::<$db>::new("");
                Self::push_touch(&mut query, user, m);
                let updated = query.build().execute(&mut *conn).await?;
                if updated.rows_affected() == 0 {
                    return Err(StoreError::NotFound);
                }
                Ok(())
            }

            /// The update of [`touch_conversation`](Self::touch_conversation). The second answer
            /// of a comparison does not take over the branch: A stays active until a vote says
            /// otherwise.
            fn push_touch<'a>(query: &mut sqlx::QueryBuilder<'a, $db>, user: &'a UserId, m: &'a Message) {
                query.push("update conversations set active_leaf_id = case when ");
                query.push_bind(m.variant.as_deref() == Some("b"));
                query.push(" then active_leaf_id else ").push_bind(m.id);
                query.push(" end, message_count = message_count + 1, last_message_at = ").push_bind(m.created_at);
                query.push(", updated_at = ").push_bind(m.created_at);
                query.push(" where id = ").push_bind(m.conversation_id);
                query.push(" and user_id = ").push_bind(user);
            }

        }
    };
}

pub(crate) use impl_store;
