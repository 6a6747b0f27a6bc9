//! Conversations, messages, comparisons and context state (see [`ConversationStore`]).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Type};
use uuid::Uuid;

use super::statements::Statements;
use super::{Conn, Row, write};
use crate::domain::webhook::{FeedbackReport, Report, VoteReport};
use crate::domain::{Comparison, ContextState, Conversation, Feedback, Message, Preference, Vote, now};
use crate::ids::{ComparisonId, ConversationId, MessageId, UserId};
use crate::store::rows::*;
use crate::store::*;

#[async_trait::async_trait]
impl<B> ConversationStore for B
where
    B: Statements,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> ConversationRow: FromRow<'r, Row<B>>,
    for<'r> MessageRow: FromRow<'r, Row<B>>,
    for<'r> ComparisonRow: FromRow<'r, Row<B>>,
    for<'r> (Json<Value>,): FromRow<'r, Row<B>>,
    for<'r> (Uuid,): FromRow<'r, Row<B>>,
    for<'r> (String,): FromRow<'r, Row<B>>,
    for<'r> (Uuid, Option<Uuid>): FromRow<'r, Row<B>>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> JsonText: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<&'q str>: Encode<'q, B::Db>,
    for<'q> Option<JsonText>: Encode<'q, B::Db>,
    for<'q> Option<Uuid>: Encode<'q, B::Db>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> i64: Encode<'q, B::Db> + Type<B::Db>,
{
    async fn create_conversation(&self, c: &Conversation) -> Result<(), StoreError> {
        write(self, async |conn| <B as Statements>::insert_conversation(conn, c).await).await
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
                sqlx::query_as(&sql).bind(user).bind(i64::from(limit)).fetch_all(self.pool()).await?
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
                    .fetch_all(self.pool())
                    .await?
            }
        };
        Ok(rows.into_iter().map(Conversation::from).collect())
    }

    async fn get_conversation(&self, user: &UserId, id: ConversationId) -> Result<Conversation, StoreError> {
        let sql = format!("select {CONVERSATION_COLUMNS} from conversations where id = $1 and user_id = $2");
        let row: Option<ConversationRow> = sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(self.pool()).await?;
        row.map(Conversation::from).ok_or(StoreError::NotFound)
    }

    async fn conversation_by_external_id(&self, user: &UserId, external_id: &str) -> Result<Conversation, StoreError> {
        let sql = format!("select {CONVERSATION_COLUMNS} from conversations where user_id = $1 and external_id = $2");
        let row: Option<ConversationRow> =
            sqlx::query_as(&sql).bind(user).bind(external_id).fetch_optional(self.pool()).await?;
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
        let row: Option<ConversationRow> = write(self, async |conn| {
            Ok(sqlx::query_as(&sql)
                .bind(id)
                .bind(user)
                .bind(patch.title.as_deref())
                .bind(patch.profile.as_deref())
                .bind(patch.system_prompt.as_deref())
                .bind(patch.metadata.as_ref().map(json))
                .bind(now())
                .fetch_optional(conn)
                .await?)
        })
        .await?;
        row.map(Conversation::from).ok_or(StoreError::NotFound)
    }

    async fn delete_conversation(&self, user: &UserId, id: ConversationId) -> Result<Vec<String>, StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(&mut *conn, B::BEGIN_WRITE).await?;
            let carried: Vec<(Uuid,)> = sqlx::query_as(
                "select distinct f.file_id from message_files f join messages m on m.id = f.message_id \
                 where m.conversation_id = $1 and m.user_id = $2",
            )
            .bind(id)
            .bind(user)
            .fetch_all(&mut *tx)
            .await?;
            let done = sqlx::query("delete from conversations where id = $1 and user_id = $2")
                .bind(id)
                .bind(user)
                .execute(&mut *tx)
                .await?;
            if B::rows_affected(&done) == 0 {
                return Err(StoreError::NotFound);
            }
            let mut freed = Vec::new();
            let lock = format!("select id from files where id = $1 {}", B::LOCK_ROW);
            for (file,) in carried {
                // A start that attaches the file meanwhile (on Postgres) waits for this, or
                // this for it: its message's use is then seen.
                let _: Option<(Uuid,)> = sqlx::query_as(&lock).bind(file).fetch_optional(&mut *tx).await?;
                let gone: Option<(String,)> = sqlx::query_as(
                    "delete from files where id = $1 \
                     and not exists (select 1 from message_files where file_id = $1) returning sha256",
                )
                .bind(file)
                .fetch_optional(&mut *tx)
                .await?;
                freed.extend(gone.map(|(sha,)| sha));
            }
            tx.commit().await?;
            Ok(freed)
        })
        .await
    }

    async fn messages(&self, user: &UserId, conversation_id: ConversationId) -> Result<Vec<Message>, StoreError> {
        let sql = format!(
            "select {MESSAGE_COLUMNS} from messages where conversation_id = $1 and user_id = $2 \
             order by created_at, id"
        );
        let rows: Vec<MessageRow> =
            sqlx::query_as(&sql).bind(conversation_id).bind(user).fetch_all(self.pool()).await?;
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
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            let row: Option<MessageRow> = sqlx::query_as(&sql)
                .bind(message_id)
                .bind(user)
                .bind(feedback.as_ref().map(json))
                .fetch_optional(&mut *tx)
                .await?;
            let message: Message = row.ok_or(StoreError::NotFound)?.try_into()?;
            // Feedback given (set or changed) is reported; a cleared one is not.
            let mut reported = false;
            if let Some(feedback) = feedback.filter(|f| f.rating.is_some() || f.comment.is_some()) {
                let report = FeedbackReport {
                    message_id,
                    conversation_id: message.conversation_id,
                    user_id: user.clone(),
                    feedback,
                };
                reported = super::outbox::report(self, &mut *tx, &Report::Feedback(report)).await?;
            }
            tx.commit().await?;
            super::outbox::written(self, reported);
            Ok(message)
        })
        .await
    }

    async fn get_message(&self, user: &UserId, id: MessageId) -> Result<Message, StoreError> {
        let sql = format!("select {MESSAGE_COLUMNS} from messages where id = $1 and user_id = $2");
        let row: Option<MessageRow> = sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(self.pool()).await?;
        row.ok_or(StoreError::NotFound)?.try_into()
    }

    async fn delete_answer(&self, user: &UserId, id: MessageId) -> Result<(), StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(&mut *conn, B::BEGIN_WRITE).await?;
            let found: Option<(Uuid, Option<Uuid>)> = sqlx::query_as(
                "select conversation_id, parent_id from messages where id = $1 and user_id = $2 and role = 'assistant'",
            )
            .bind(id)
            .bind(user)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((conversation, parent)) = found else { return Err(StoreError::NotFound) };
            <B as Statements>::follow_question(&mut tx, conversation, id, parent.map(MessageId)).await?;
            <B as Statements>::remove_message(&mut tx, conversation, id, parent.map(MessageId)).await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn append_messages(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        mut messages: Vec<Message>,
    ) -> Result<Vec<Message>, StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(&mut *conn, B::BEGIN_WRITE).await?;
            let found: Option<(Uuid, Option<Uuid>)> =
                sqlx::query_as("select id, active_leaf_id from conversations where id = $1 and user_id = $2")
                    .bind(conversation_id)
                    .bind(user)
                    .fetch_optional(&mut *tx)
                    .await?;
            let Some((_, mut parent)) = found else { return Err(StoreError::NotFound) };
            for m in &mut messages {
                (m.conversation_id, m.parent_id) = (conversation_id, parent.map(MessageId));
                <B as Statements>::append_message(&mut tx, user, m).await?;
                parent = Some(m.id.0);
            }
            tx.commit().await?;
            Ok(())
        })
        .await?;
        Ok(messages)
    }

    async fn delete_last_message(&self, user: &UserId, id: MessageId) -> Result<(), StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(&mut *conn, B::BEGIN_WRITE).await?;
            let found: Option<(Uuid, Option<Uuid>)> =
                sqlx::query_as("select conversation_id, parent_id from messages where id = $1 and user_id = $2")
                    .bind(id)
                    .bind(user)
                    .fetch_optional(&mut *tx)
                    .await?;
            let Some((conversation, parent)) = found else { return Err(StoreError::NotFound) };
            let followed: Option<(Uuid,)> = sqlx::query_as("select id from messages where parent_id = $1 limit 1")
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
            if followed.is_some() {
                return Err(StoreError::Conflict("Other messages follow this one".into()));
            }
            <B as Statements>::remove_message(&mut tx, conversation, id, parent.map(MessageId)).await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn set_active_leaf(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        leaf: MessageId,
    ) -> Result<(), StoreError> {
        let done = write(self, async |conn| {
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
        if B::rows_affected(&done) == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    async fn get_comparison(&self, user: &UserId, id: ComparisonId) -> Result<Comparison, StoreError> {
        let sql = format!("select {COMPARISON_COLUMNS} from comparisons where id = $1 and user_id = $2");
        let row: Option<ComparisonRow> = sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(self.pool()).await?;
        row.ok_or(StoreError::NotFound)?.try_into()
    }

    async fn vote(
        &self,
        user: &UserId,
        id: ComparisonId,
        preference: Preference,
        change: bool,
    ) -> Result<Comparison, StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
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
                .bind(json(&comparison.vote_history))
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
            let reported = super::outbox::report(self, &mut *tx, &Report::Voted(VoteReport::from(&comparison))).await?;
            tx.commit().await?;
            super::outbox::written(self, reported);
            Ok(comparison)
        })
        .await
    }

    async fn voted_comparisons(&self) -> Result<Vec<Comparison>, StoreError> {
        let sql =
            format!("select {COMPARISON_COLUMNS} from comparisons where voted_at is not null order by voted_at, id");
        let rows: Vec<ComparisonRow> = sqlx::query_as(&sql).fetch_all(self.pool()).await?;
        rows.into_iter().map(Comparison::try_from).collect()
    }

    async fn context_state(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
    ) -> Result<Option<ContextState>, StoreError> {
        let row: Option<(Json<Value>,)> =
            sqlx::query_as("select state from context_states where conversation_id = $1 and user_id = $2")
                .bind(conversation_id)
                .bind(user)
                .fetch_optional(self.pool())
                .await?;
        Ok(row.and_then(|(state,)| crate::store::rows::context_state(state.0)))
    }

    async fn set_context_state(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        state: Option<&ContextState>,
    ) -> Result<(), StoreError> {
        write(self, async |conn| {
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
                    .bind(json(state))
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
}
