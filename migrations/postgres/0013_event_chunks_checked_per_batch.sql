-- The event log's chunks are checked against their runs once per write, as a set, instead of
-- row by row: the foreign key ran a query and took a lock for every row (at 1,000 streams,
-- 1,000 rows every flush, more than half of the insert's time). The insert now joins its
-- rows with their traces under the same lock (src/store/postgres.rs, insert_chunks), so a
-- run whose trace is gone (its conversation deleted meanwhile) writes nothing, as before;
-- and a trace deleted takes its chunks with it, as the key's cascade did.
alter table trace_event_chunks drop constraint trace_event_chunks_trace_id_fkey;

create function trace_event_chunks_follow_their_trace() returns trigger language plpgsql as $$
begin
    delete from trace_event_chunks where trace_id = old.id;
    return old;
end
$$;

create trigger traces_take_their_chunks after delete on traces
    for each row execute function trace_event_chunks_follow_their_trace();
