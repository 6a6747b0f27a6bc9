-- The event log in two parts. While a run streams, its chunks are appended to
-- trace_event_chunks in write order with no index: an index led by the run put every flush's
-- rows in a thousand places, and SQLite wrote a page for each (a gigabyte of WAL for 25 MB of
-- events at 1,000 streams). When the run ends, its whole log is written once, as one row of
-- trace_logs, and its chunks become garbage, deleted in order from the front of the table.
--
-- traces.log_from is the last chunk id written before the run started: its chunks come after.
-- traces.log_sealed is 0 until the run's row in trace_logs is written; no chunk at or below
-- the smallest log_from of an unsealed run is deleted.
create table trace_logs (
    trace_id blob primary key not null references traces (id) on delete cascade,
    events text not null
);

insert into trace_logs (trace_id, events)
select trace_id, '[' || group_concat(substr(events, 2, length(events) - 2), ',' order by first_seq) || ']'
from trace_event_chunks
group by trace_id;

create table trace_event_chunks_unindexed (
    id integer primary key,
    trace_id blob not null,
    first_seq integer not null,
    last_seq integer not null,
    events text not null
);
drop table trace_event_chunks;
alter table trace_event_chunks_unindexed rename to trace_event_chunks;

alter table traces add column log_from integer not null default 0;
alter table traces add column log_sealed integer not null default 1;
create index traces_unsealed on traces (log_from) where log_sealed = 0;

create trigger traces_log_from after insert on traces
begin
    update traces set log_from = (select coalesce(max(id), 0) from trace_event_chunks), log_sealed = 0
    where id = new.id;
end;
