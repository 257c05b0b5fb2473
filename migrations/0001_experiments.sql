-- The experiment database: jobs, one attempt per child process, per-attempt samples, events.
CREATE TABLE jobs (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    name            TEXT    NOT NULL,
    policy          TEXT    NOT NULL,
    spec_yaml       TEXT    NOT NULL,           -- the job as submitted (validated)
    current_spec    TEXT    NOT NULL,           -- the configuration of the current/last rung (JSON)
    status          TEXT    NOT NULL,           -- queued | running | finished | failed | cancelled
    rung            TEXT    NOT NULL DEFAULT 'base',
    rung_index      INTEGER NOT NULL DEFAULT -1,
    steps_requested INTEGER NOT NULL,
    steps_done      INTEGER NOT NULL DEFAULT 0,
    capacity        INTEGER,
    reason          TEXT,                       -- why it failed or was cancelled
    created_at      REAL    NOT NULL,
    updated_at      REAL    NOT NULL,
    finished_at     REAL
);
CREATE INDEX jobs_status ON jobs(status);

CREATE TABLE attempts (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id             INTEGER NOT NULL REFERENCES jobs(id),
    number             INTEGER NOT NULL,        -- 1-based within the job
    rung               TEXT    NOT NULL,
    config_json        TEXT    NOT NULL,        -- the full resolved job spec of this attempt
    pid                INTEGER,                 -- the trainer child's process id
    started_at         REAL    NOT NULL,
    ended_at           REAL,
    outcome            TEXT,                    -- finished|oom|preempted|crashed|cancelled|swap_bound
    exit_code          INTEGER,
    first_step         INTEGER,
    last_step          INTEGER,
    resumed_from_step  INTEGER,
    capacity           INTEGER,
    peak_params        INTEGER,
    peak_grads         INTEGER,
    peak_optimizer     INTEGER,
    peak_activations   INTEGER,
    peak_workspace     INTEGER,
    peak_allocated     INTEGER,
    peak_reserved      INTEGER,
    mean_tokens_per_s  REAL,
    oom_category       TEXT,
    oom_requested      INTEGER,
    message            TEXT
);
CREATE INDEX attempts_job ON attempts(job_id);

CREATE TABLE samples (
    attempt_id     INTEGER NOT NULL REFERENCES attempts(id),
    step           INTEGER NOT NULL,
    t              REAL    NOT NULL,
    loss           REAL,
    val_loss       REAL,
    tokens_per_s   REAL,
    step_ms        REAL,
    params         INTEGER,
    grads          INTEGER,
    optimizer      INTEGER,
    activations    INTEGER,
    workspace      INTEGER,
    allocated      INTEGER,
    reserved       INTEGER,
    fragmentation  INTEGER,
    capacity       INTEGER
);
CREATE INDEX samples_attempt ON samples(attempt_id, step);

CREATE TABLE events (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id      INTEGER NOT NULL REFERENCES jobs(id),
    attempt_id  INTEGER REFERENCES attempts(id),
    t           REAL    NOT NULL,
    kind        TEXT    NOT NULL,               -- submitted|attempt_started|warn|preempt|oom|step_down|skip|retry|finished|failed|cancelled|resumed
    message     TEXT    NOT NULL
);
CREATE INDEX events_job ON events(job_id, id);
