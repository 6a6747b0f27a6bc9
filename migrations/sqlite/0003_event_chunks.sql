-- The event log keeps a run's events in chunks, one row per run per flush (src/store/chunks.rs):
-- a JSON array of [seq, at in microseconds since the epoch, event]. Events logged before this
-- migration keep their time to the millisecond.
create table trace_event_chunks (
    trace_id blob not null references traces (id) on delete cascade,
    first_seq integer not null,
    last_seq integer not null,
    events text not null,
    primary key (trace_id, first_seq)
) without rowid;

insert into trace_event_chunks (trace_id, first_seq, last_seq, events)
select trace_id, seq, seq,
       json_array(json_array(seq, cast(round(unixepoch(at, 'subsec') * 1000) as integer) * 1000, json(data)))
from trace_events;

drop table trace_events;
