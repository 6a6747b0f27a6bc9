-- A response's `metadata` (the OpenAI Responses API, CONTRACT.md §20): what the request
-- gave, kept with its run and answered with each of its responses. Null where none.
alter table traces add column metadata text;
