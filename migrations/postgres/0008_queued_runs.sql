-- Runs queued behind others of their conversation (multitask "enqueue"): found by
-- conversation, as running and waiting runs are.
create index traces_queued_by_conversation on traces (conversation_id) where status = 'queued';
