-- One row that readiness rewrites while writes are failing, to learn whether they work again
-- (a write that changes a page, as an answer's does).
create table write_probe (
    id integer primary key check (id = 1),
    at text not null
);
