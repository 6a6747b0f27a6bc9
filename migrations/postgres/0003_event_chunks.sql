-- The event log keeps a run's events in chunks, one row per run per flush (src/store/chunks.rs):
-- a JSON array of [seq, at in microseconds since the epoch, event], kept as text (never
-- queried inside, and written without parsing).
create table trace_event_chunks (
    trace_id uuid not null references traces (id) on delete cascade,
    first_seq bigint not null,
    last_seq bigint not null,
    events text not null,
    primary key (trace_id, first_seq)
);

insert into trace_event_chunks (trace_id, first_seq, last_seq, events)
select trace_id, seq, seq,
       jsonb_build_array(jsonb_build_array(seq, (extract(epoch from at) * 1000000)::bigint, data))::text
from trace_events;

drop table trace_events;
