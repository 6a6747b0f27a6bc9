-- The event log's chunks are stored in the order they are written, with an index to find a
-- run's. Keyed by (trace_id, first_seq) itself, every flush inserted one row next to each
-- active run's earlier ones, all over the table: with a thousand runs streaming, nearly every
-- page changed at every flush, and SQLite wrote and checkpointed each of them (a fifth of
-- chatd's CPU at 1,000 streams of 20 tokens/s). Appended in order, a flush changes the last
-- pages of the table and a small index.
create table trace_event_chunks_in_order (
    id integer primary key,
    trace_id blob not null references traces (id) on delete cascade,
    first_seq integer not null,
    last_seq integer not null,
    events text not null
);

insert into trace_event_chunks_in_order (trace_id, first_seq, last_seq, events)
select trace_id, first_seq, last_seq, events from trace_event_chunks order by trace_id, first_seq;

drop table trace_event_chunks;
alter table trace_event_chunks_in_order rename to trace_event_chunks;
create unique index trace_event_chunks_by_run on trace_event_chunks (trace_id, first_seq);
