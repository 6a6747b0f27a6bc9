-- Each replica's heartbeat (CONTRACT.md §19): one row per process, written once per
-- `runs.heartbeat_secs` whatever the number of runs it holds. A running or queued trace is
-- held alive while its replica's row is fresh; one whose replica went quiet for
-- `runs.takeover_after_secs` is taken over by another replica.
create table replicas (
    replica text primary key,
    beat_at timestamptz not null
);
