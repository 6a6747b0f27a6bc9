-- chatd schema, Postgres: native uuid, timestamptz and jsonb. Every row names its owner
-- (user_id); deletes cascade from conversations.

create table conversations (
    id uuid primary key,
    user_id text not null,
    title text not null,
    profile text,
    system_prompt text,
    metadata jsonb not null default '{}',
    active_leaf_id uuid,
    message_count bigint not null default 0,
    created_at timestamptz not null,
    updated_at timestamptz not null,
    last_message_at timestamptz not null
);
create index conversations_by_user on conversations (user_id, last_message_at desc, id desc);

create table messages (
    id uuid primary key,
    conversation_id uuid not null references conversations (id) on delete cascade,
    user_id text not null,
    parent_id uuid,
    role text not null,
    content text not null,
    thinking text,
    provider_state jsonb,
    tool_calls jsonb not null default '[]',
    tool_history jsonb not null default '[]',
    payloads jsonb not null default '[]',
    suggested_values jsonb not null default '[]',
    suggested_actions jsonb not null default '[]',
    cancelled boolean not null default false,
    model text,
    trace_id uuid,
    usage jsonb,
    feedback jsonb,
    comparison_id uuid,
    variant text,
    created_at timestamptz not null
);
create index messages_by_conversation on messages (conversation_id, created_at, id);

create table comparisons (
    id uuid primary key,
    conversation_id uuid not null references conversations (id) on delete cascade,
    user_id text not null,
    user_message_id uuid not null,
    trace_a uuid not null,
    trace_b uuid not null,
    profile_a text not null,
    profile_b text not null,
    model_a text not null,
    model_b text not null,
    preference text,
    voted_at timestamptz,
    created_at timestamptz not null
);

create table traces (
    id uuid primary key,
    conversation_id uuid not null references conversations (id) on delete cascade,
    user_id text not null,
    user_message_id uuid not null,
    message_id uuid not null,
    status text not null,
    model text not null,
    profile text not null,
    started_at timestamptz not null,
    ended_at timestamptz,
    usage jsonb,
    error jsonb,
    spans jsonb not null default '[]',
    comparison_id uuid,
    variant text,
    -- which chatd process runs it, and when that process last said it was alive
    replica_id text,
    heartbeat_at timestamptz
);
create index traces_by_message on traces (message_id);
create index traces_running on traces (status) where status = 'running';

create table trace_events (
    trace_id uuid not null references traces (id) on delete cascade,
    seq bigint not null,
    at timestamptz not null,
    type text not null,
    data jsonb not null,
    primary key (trace_id, seq)
);

create table context_states (
    conversation_id uuid primary key references conversations (id) on delete cascade,
    user_id text not null,
    strategy text not null,
    state jsonb not null,
    updated_at timestamptz not null
);
