-- Each replica's heartbeat (CONTRACT.md §19): one row per process, written once per
-- `runs.heartbeat_secs` whatever the number of runs it holds. (SQLite has one process: the
-- table is there so that both backends read running traces the same way.)
create table replicas (
    replica text primary key,
    beat_at text not null
);
