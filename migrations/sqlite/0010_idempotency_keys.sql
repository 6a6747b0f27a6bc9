-- Idempotency-Key (CONTRACT.md §16): the run a user's key started, and a hash of the request
-- that started it, written in the start's own transaction, so that a repeat of the request
-- (a retry, a double click, another replica) gets that run, never a second one.
create table idempotency_keys (
    user_id text not null,
    key text not null,
    request_hash text not null,
    trace_id blob not null,
    created_at text not null,
    primary key (user_id, key)
);
create index idempotency_keys_by_age on idempotency_keys (created_at);
