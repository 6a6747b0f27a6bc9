-- What runs cost (CONTRACT.md §18). The answer and its trace say what each cost; `run_usage`
-- keeps one row per run for the sums of /api/usage and the budgets: apart from the
-- conversation, so that deleting a conversation does not undo what its runs spent. A run's
-- row is written as it starts where a budget applies (with what it reserves), and as it ends.
alter table messages add column cost_usd double precision;
alter table traces add column cost_usd double precision;
create table run_usage (
    trace_id uuid primary key,
    user_id text not null,
    profile text not null,
    model text not null,
    started_at timestamptz not null,
    input_tokens bigint not null default 0,
    output_tokens bigint not null default 0,
    cache_read_tokens bigint not null default 0,
    cache_write_tokens bigint not null default 0,
    -- what a going run holds of its user's budgets for its next model call (its request's
    -- estimate and its output allowance); 0 once it ended
    reserved_tokens bigint not null default 0,
    reserved_usd double precision not null default 0,
    -- null where a call had no known price
    cost_usd double precision
);
-- A user's sums over a period read the index alone.
create index run_usage_by_user on run_usage (user_id, started_at)
    include (profile, model, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost_usd,
             reserved_tokens, reserved_usd);
create index run_usage_by_time on run_usage (started_at);
