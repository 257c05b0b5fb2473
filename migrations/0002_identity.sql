-- The database's identity: run directories record which database (and job) they belong to, so
-- a new database never resumes another database's checkpoints from a reused runs/ folder.
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
INSERT INTO meta (key, value) VALUES ('db_id', lower(hex(randomblob(16))));
