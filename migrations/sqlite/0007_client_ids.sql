-- Ids that client libraries make (CONTRACT.md §13): the AI SDK's chat id and AG-UI's thread id
-- name a conversation as its `external_id`, unique per user; a user message keeps the id its
-- client gave it, so that a later edit of that message finds it.
alter table conversations add column external_id text;
create unique index conversations_by_external_id on conversations (user_id, external_id)
    where external_id is not null;
alter table messages add column client_id text;
-- A conversation's running runs (cancel by conversation, §17; resume by chat id, §13.1).
create index traces_running_by_conversation on traces (conversation_id) where status = 'running';
