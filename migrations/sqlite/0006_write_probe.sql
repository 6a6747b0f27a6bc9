-- One row that readiness rewrites while writes are failing, to learn whether they work again:
-- 64 KiB at a time, so that a disk with room for a tiny write but not for an answer is not
-- taken for healed.
create table write_probe (
    id integer primary key check (id = 1),
    at text not null,
    payload blob not null
);
