-- Every vote on a comparison, in order: a changed vote keeps the earlier ones.
alter table comparisons add column vote_history jsonb not null default '[]';
create index comparisons_voted on comparisons (voted_at) where voted_at is not null;
