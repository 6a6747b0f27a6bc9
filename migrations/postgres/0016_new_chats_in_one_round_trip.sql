-- A group of starts that only opens new chats is written in one statement and one round
-- trip, committed with its own answer (src/store/sql/starts.rs, start_new_chats), where
-- other starts take three (BEGIN with the locks, the statement, COMMIT). Their one check is
-- the users' limits of running runs, which this function makes, called as that statement's
-- main query (its writes are `with` queries): it takes each user's lock (the key every other
-- start takes, kind 7, in the users' order), counts the user's running runs with a snapshot
-- taken after the lock (a volatile function's queries take fresh ones; the statement's own
-- was taken before), the group's own traces left out whenever its writes run, and fails the
-- whole statement where the runs the group adds would pass a limit. The lock is held until
-- the statement commits, so the next start of the user counts these runs.
create function chatd_hold_running(users text[], adding bigint[], limits bigint[], ours uuid[])
returns integer language plpgsql volatile as $$
declare
    running bigint;
begin
    for i in 1 .. coalesce(array_length(users, 1), 0) loop
        perform pg_advisory_xact_lock(hashtextextended(users[i], 7));
        select count(*) into running from traces where user_id = users[i] and status = 'running';
        -- Less the group's own, where its writes ran first (a statement's parts run in no set
        -- order): looked up by key, where `id <> all(ours)` compared every running run with
        -- each of them (10 ms for a group of 500 among 1,000).
        select running - count(*) into running from traces
            where id = any(ours) and user_id = users[i] and status = 'running';
        if running + adding[i] > limits[i] then
            raise exception using errcode = 'CH429', message = format('over the limit of running runs: %s', running);
        end if;
    end loop;
    return 0;
end
$$;
