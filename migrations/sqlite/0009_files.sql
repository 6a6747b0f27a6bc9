-- Attachments (CONTRACT.md §14). A file's bytes are kept in the file storage under their
-- sha256 (one copy for every file with the same bytes); its row says whose it is. A message
-- keeps its attachments as JSON to show them, and one row a file in message_files, so that
-- a file still in use by a message can be told from one that is not.
create table files (
    id blob primary key not null,
    user_id text not null,
    name text not null,
    media_type text not null,
    size integer not null,
    sha256 text not null,
    width integer,
    height integer,
    created_at text not null
);
create index files_by_sha256 on files (sha256);
create table message_files (
    message_id blob not null references messages (id) on delete cascade,
    position integer not null,
    file_id blob not null references files (id) on delete cascade,
    primary key (message_id, position)
);
create index message_files_by_file on message_files (file_id);
alter table messages add column attachments text not null default '[]';
