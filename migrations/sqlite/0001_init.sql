-- chatd schema, SQLite. Ids are 16-byte UUID blobs, times RFC 3339 text (UTC, microseconds),
-- JSON as text. Every row names its owner (user_id); deletes cascade from conversations.

create table conversations (
    id blob primary key not null,
    user_id text not null,
    title text not null,
    profile text,
    system_prompt text,
    metadata text not null default '{}',
    active_leaf_id blob,
    message_count integer not null default 0,
    created_at text not null,
    updated_at text not null,
    last_message_at text not null
);
create index conversations_by_user on conversations (user_id, last_message_at desc, id desc);

create table messages (
    id blob primary key not null,
    conversation_id blob not null references conversations (id) on delete cascade,
    user_id text not null,
    parent_id blob,
    role text not null,
    content text not null,
    thinking text,
    provider_state text,
    tool_calls text not null default '[]',
    tool_history text not null default '[]',
    payloads text not null default '[]',
    suggested_values text not null default '[]',
    suggested_actions text not null default '[]',
    cancelled integer not null default 0,
    model text,
    trace_id blob,
    usage text,
    feedback text,
    comparison_id blob,
    variant text,
    created_at text not null
);
create index messages_by_conversation on messages (conversation_id, created_at, id);

create table comparisons (
    id blob primary key not null,
    conversation_id blob not null references conversations (id) on delete cascade,
    user_id text not null,
    user_message_id blob not null,
    trace_a blob not null,
    trace_b blob not null,
    profile_a text not null,
    profile_b text not null,
    model_a text not null,
    model_b text not null,
    preference text,
    voted_at text,
    created_at text not null
);

create table traces (
    id blob primary key not null,
    conversation_id blob not null references conversations (id) on delete cascade,
    user_id text not null,
    user_message_id blob not null,
    message_id blob not null,
    status text not null,
    model text not null,
    profile text not null,
    started_at text not null,
    ended_at text,
    usage text,
    error text,
    spans text not null default '[]',
    comparison_id blob,
    variant text,
    -- which chatd process runs it, and when that process last said it was alive
    replica_id text,
    heartbeat_at text
);
create index traces_by_message on traces (message_id);
create index traces_running on traces (status) where status = 'running';

create table trace_events (
    trace_id blob not null references traces (id) on delete cascade,
    seq integer not null,
    at text not null,
    type text not null,
    data text not null,
    primary key (trace_id, seq)
) without rowid;

create table context_states (
    conversation_id blob primary key not null references conversations (id) on delete cascade,
    user_id text not null,
    strategy text not null,
    state text not null,
    updated_at text not null
);
