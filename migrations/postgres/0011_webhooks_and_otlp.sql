-- Webhooks (CONTRACT.md §18). A message is written in the same transaction as what it
-- reports, one per endpoint that takes its event; its id is the `webhook-id` of every
-- attempt. A process claims due messages by moving `next_attempt_at` past the attempt (one
-- that dies mid-attempt lets them fall due again); `attempts` counts claims.
create table webhook_outbox (
    id text primary key,
    endpoint text not null,
    event_type text not null,
    body text not null,
    -- pending, delivered, failed, disabled
    status text not null default 'pending',
    attempts integer not null default 0,
    next_attempt_at timestamptz not null,
    last_status integer,
    last_error text,
    created_at timestamptz not null,
    delivered_at timestamptz
);
create index webhook_outbox_due on webhook_outbox (next_attempt_at) where status = 'pending';
create index webhook_outbox_recent on webhook_outbox (created_at);
-- Endpoints that answered 410 Gone, until their configuration changes.
create table webhook_endpoints_disabled (
    endpoint text primary key,
    fingerprint text not null,
    disabled_at timestamptz not null
);
-- The request's traceparent (W3C Trace Context), where one came: the run's OTLP spans join
-- that trace, whichever replica ends the run (CONTRACT.md §18).
alter table traces add column traceparent text;
