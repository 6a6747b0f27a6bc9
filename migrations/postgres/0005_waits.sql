-- Runs that wait (CONTRACT.md §15). A waiting run's trace has status 'waiting' and keeps, in
-- `checkpoint`, what its continuation needs (the model request so far, the answer so far, the
-- turn whose calls wait); each call it waits for is a row of run_waits: an approval, or a
-- client tool's result. Deciding the last one hands the run to the replica that decided it.
alter table traces add column checkpoint jsonb;

create table run_waits (
    id uuid primary key,
    trace_id uuid not null references traces (id) on delete cascade,
    user_id text not null,
    -- 'approval' or 'client_tool'
    kind text not null,
    tool_call_id text not null,
    tool text not null,
    input jsonb not null,
    created_at timestamptz not null,
    expires_at timestamptz,
    -- how it was settled: 'approved', 'denied', 'expired' or 'result'
    outcome text,
    decided_at timestamptz,
    reason text,
    output text,
    is_error boolean not null default false
);
-- A run's waits by call (a provider may reuse a call id in a later model call: the newest
-- park's is the one a result answers).
create index run_waits_by_call on run_waits (trace_id, tool_call_id);
-- The expiry sweep's question: undecided approvals by deadline.
create index run_waits_open on run_waits (expires_at) where decided_at is null;
create index traces_waiting_by_conversation on traces (conversation_id) where status = 'waiting';
