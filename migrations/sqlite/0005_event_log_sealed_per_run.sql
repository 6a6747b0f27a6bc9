-- The event log's chunks without an index. An index led by the run put every flush's rows in
-- a thousand places, and SQLite wrote a page for each: a gigabyte of WAL for 25 MB of events
-- at 1,000 streams. Chunks are now only appended, in write order. When a run ends, the ids
-- of its chunks are written once, as its row of trace_logs ("sealed"); a running run's
-- chunks are found from traces.log_from, the last chunk id written before it started.
create table trace_logs (
    trace_id blob primary key not null references traces (id) on delete cascade,
    -- a JSON array of trace_event_chunks ids
    chunk_ids text not null
);

create table trace_event_chunks_unindexed (
    id integer primary key,
    trace_id blob not null,
    first_seq integer not null,
    last_seq integer not null,
    events text not null
);
insert into trace_event_chunks_unindexed (id, trace_id, first_seq, last_seq, events)
select id, trace_id, first_seq, last_seq, events from trace_event_chunks;
insert into trace_logs (trace_id, chunk_ids)
select trace_id, json_group_array(id) from trace_event_chunks group by trace_id;
drop table trace_event_chunks;
alter table trace_event_chunks_unindexed rename to trace_event_chunks;

-- A run's chunks go with its log, and so with its trace and conversation.
create trigger trace_logs_take_their_chunks after delete on trace_logs
begin
    delete from trace_event_chunks where id in (select value from json_each(old.chunk_ids));
end;

alter table traces add column log_from integer not null default 0;
alter table traces add column log_sealed integer not null default 1;
create index traces_unsealed on traces (log_from) where log_sealed = 0;

create trigger traces_log_from after insert on traces
begin
    update traces set log_from = (select coalesce(max(id), 0) from trace_event_chunks), log_sealed = 0
    where id = new.id;
end;
