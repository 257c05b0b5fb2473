//! The experiment database (SQLite through sqlx, WAL mode, migrations/): jobs, attempts,
//! samples and events, and every query the supervisor and the HTTP API make.

use std::future::Future;
use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::SqlitePool;

pub type DbResult<T> = Result<T, sqlx::Error>;

pub fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// The experiment database. Every query is retried while SQLite says "busy" or "locked" (another
/// connection or process holds the write lock), for up to `patience`: a storage hiccup delays
/// the supervisor, it never fails a job.
#[derive(Clone, Debug)]
pub struct Db {
    pub pool: SqlitePool,
    patience: Duration,
}

/// How long the HTTP handlers wait out a busy database before answering 503.
pub const REQUEST_PATIENCE: Duration = Duration::from_secs(20);
/// How long the runner waits out a busy database (a job in flight is never failed for it).
pub const RUNNER_PATIENCE: Duration = Duration::from_secs(24 * 3600);

/// SQLite saying "not now": SQLITE_BUSY (5) or SQLITE_LOCKED (6) in any extended form
/// (517 BUSY_SNAPSHOT, 261 BUSY_RECOVERY, ...), or no pooled connection free in time.
pub fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => {
            d.code().and_then(|c| c.parse::<i64>().ok()).is_some_and(|code| matches!(code & 0xff, 5 | 6))
        }
        sqlx::Error::PoolTimedOut => true,
        _ => false,
    }
}

/// The columns of a job row both the list and the detail views show.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct JobCore {
    pub id: i64,
    pub name: String,
    pub policy: String,
    pub status: String,
    pub rung: String,
    pub rung_index: i64,
    pub steps_requested: i64,
    pub steps_done: i64,
    pub capacity: Option<i64>,
    pub reason: Option<String>,
    pub created_at: f64,
    pub updated_at: f64,
    pub finished_at: Option<f64>,
}

/// A job in the list, with aggregates over its attempts.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct JobRow {
    #[sqlx(flatten)]
    #[serde(flatten)]
    pub core: JobCore,
    pub attempts: i64,
    /// Attempts that ran out of memory (their peaks are not the job's: see `peak_*`).
    pub ooms: i64,
    /// The peaks of the configuration the job runs or ended on: its newest attempt that did
    /// not run out of memory (an OOM's peak is the capacity it hit, not what the job needs).
    pub peak_allocated: Option<i64>,
    pub peak_reserved: Option<i64>,
    pub mean_tokens_per_s: Option<f64>,
}

/// One job with its submitted spec and current configuration.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct JobDetail {
    #[sqlx(flatten)]
    #[serde(flatten)]
    pub core: JobCore,
    pub spec_yaml: String,
    pub current_spec: String,
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct AttemptRow {
    pub id: i64,
    pub job_id: i64,
    pub number: i64,
    pub rung: String,
    pub config_json: String,
    pub pid: Option<i64>,
    pub started_at: f64,
    pub ended_at: Option<f64>,
    pub outcome: Option<String>,
    pub exit_code: Option<i64>,
    pub first_step: Option<i64>,
    pub last_step: Option<i64>,
    pub resumed_from_step: Option<i64>,
    pub capacity: Option<i64>,
    pub peak_params: Option<i64>,
    pub peak_grads: Option<i64>,
    pub peak_optimizer: Option<i64>,
    pub peak_activations: Option<i64>,
    pub peak_workspace: Option<i64>,
    pub peak_allocated: Option<i64>,
    pub peak_reserved: Option<i64>,
    pub mean_tokens_per_s: Option<f64>,
    pub oom_category: Option<String>,
    pub oom_requested: Option<i64>,
    pub message: Option<String>,
    /// The planner's record (migration 0003; absent on attempts recorded before it).
    pub device_kind: Option<String>,
    pub predicted_allocated: Option<i64>,
    pub predicted_tokens_per_s: Option<f64>,
    pub model_tokens_per_s: Option<f64>,
    /// The plan (`planner::Plan`) as a JSON object in the API (`plan`), not a string.
    #[serde(rename = "plan", serialize_with = "json_text")]
    pub plan_json: Option<String>,
    /// An OOM attempt's memory when the request failed, per category and reserved
    /// (migration 0004).
    pub oom_params: Option<i64>,
    pub oom_grads: Option<i64>,
    pub oom_optimizer: Option<i64>,
    pub oom_activations: Option<i64>,
    pub oom_workspace: Option<i64>,
    pub oom_reserved: Option<i64>,
}

/// A JSON column written as the value it holds (null when absent or unreadable).
fn json_text<S: serde::Serializer>(text: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    let value: Option<serde_json::Value> = text.as_deref().and_then(|t| serde_json::from_str(t).ok());
    serde::Serialize::serialize(&value, s)
}

/// Part of a preemption's message when memory other processes held caused it (the monitor
/// writes it, `failed_configs` reads it).
pub const OTHERS_MARK: &str = "held by other processes";

/// What an attempt is started with besides its configuration: the planner's predictions.
#[derive(Debug, Clone, Default)]
pub struct AttemptPlan {
    pub device_kind: String,
    pub predicted_allocated: Option<i64>,
    pub predicted_tokens_per_s: Option<f64>,
    pub model_tokens_per_s: Option<f64>,
    pub plan_json: Option<String>,
}

/// One ended attempt of a device's history: predictions and measurements (`planner::learn`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct HistoryRow {
    pub outcome: Option<String>,
    pub predicted_allocated: i64,
    pub peak_allocated: Option<i64>,
    pub oom_requested: Option<i64>,
    pub last_step: Option<i64>,
    pub model_tokens_per_s: Option<f64>,
    pub mean_tokens_per_s: Option<f64>,
}

/// A finished job a new one may start from (`planner::warm_start`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct FinishedJob {
    pub id: i64,
    pub policy: String,
    pub spec_yaml: String,
    pub current_spec: String,
    pub rung: String,
    pub rung_index: i64,
}

#[derive(Debug, Clone, Default, Serialize, sqlx::FromRow)]
pub struct SampleRow {
    pub attempt_id: i64,
    pub step: i64,
    pub t: f64,
    pub loss: Option<f64>,
    pub val_loss: Option<f64>,
    pub tokens_per_s: Option<f64>,
    pub step_ms: Option<f64>,
    pub params: Option<i64>,
    pub grads: Option<i64>,
    pub optimizer: Option<i64>,
    pub activations: Option<i64>,
    pub workspace: Option<i64>,
    pub allocated: Option<i64>,
    pub reserved: Option<i64>,
    pub fragmentation: Option<i64>,
    pub capacity: Option<i64>,
    /// What each category held, and the pool reserved, when the step's allocated total peaked
    /// (migration 0004): these sum to `allocated`.
    pub at_peak_params: Option<i64>,
    pub at_peak_grads: Option<i64>,
    pub at_peak_optimizer: Option<i64>,
    pub at_peak_activations: Option<i64>,
    pub at_peak_workspace: Option<i64>,
    pub at_peak_reserved: Option<i64>,
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct EventRow {
    pub id: i64,
    pub job_id: i64,
    pub attempt_id: Option<i64>,
    pub t: f64,
    pub kind: String,
    pub message: String,
}

/// A job as submitted: what `create_job` stores.
#[derive(Debug, Clone)]
pub struct NewJob<'a> {
    pub name: &'a str,
    pub policy: &'a str,
    /// The body as the user sent it.
    pub spec_yaml: &'a str,
    /// The validated spec as JSON: the configuration the first attempt runs.
    pub current_spec: &'a str,
    pub steps: i64,
    pub capacity: Option<i64>,
}

/// How an attempt ended, as recorded in its row.
#[derive(Debug, Clone, Default)]
pub struct AttemptEnd {
    pub outcome: String,
    pub exit_code: Option<i64>,
    pub first_step: Option<i64>,
    pub last_step: Option<i64>,
    pub resumed_from_step: Option<i64>,
    pub capacity: Option<i64>,
    /// params, grads, optimizer, activations, workspace, allocated, reserved
    pub peaks: [Option<i64>; 7],
    pub mean_tokens_per_s: Option<f64>,
    pub oom_category: Option<String>,
    pub oom_requested: Option<i64>,
    /// params, grads, optimizer, activations, workspace, reserved when an OOM's request failed.
    pub oom_at: Option<[i64; 6]>,
    pub message: Option<String>,
}

/// Columns the jobs list can be sorted by (a closed set: never interpolate user text into SQL).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum JobSort {
    #[default]
    Id,
    Name,
    Status,
    Policy,
    Rung,
    Attempts,
    StepsDone,
    PeakReserved,
    MeanTokensPerS,
    CreatedAt,
    UpdatedAt,
}

impl JobSort {
    fn column(self) -> &'static str {
        match self {
            JobSort::Id => "j.id",
            JobSort::Name => "j.name",
            JobSort::Status => "j.status",
            JobSort::Policy => "j.policy",
            JobSort::Rung => "j.rung",
            JobSort::Attempts => "attempts",
            JobSort::StepsDone => "j.steps_done",
            JobSort::PeakReserved => "peak_reserved",
            JobSort::MeanTokensPerS => "mean_tokens_per_s",
            JobSort::CreatedAt => "j.created_at",
            JobSort::UpdatedAt => "j.updated_at",
        }
    }
}

#[derive(Debug, Clone)]
pub struct JobFilter {
    pub status: Option<String>,
    pub name_contains: Option<String>,
    pub sort: JobSort,
    pub descending: bool,
    pub limit: i64,
    pub offset: i64,
}

const JOB_LIST_SELECT: &str = "SELECT j.id, j.name, j.policy, j.status, j.rung, j.rung_index, j.steps_requested, \
    j.steps_done, j.capacity, j.reason, j.created_at, j.updated_at, j.finished_at, \
    (SELECT COUNT(*) FROM attempts a WHERE a.job_id = j.id) AS attempts, \
    (SELECT COUNT(*) FROM attempts a WHERE a.job_id = j.id AND a.outcome = 'oom') AS ooms, \
    (SELECT a.peak_allocated FROM attempts a WHERE a.job_id = j.id AND a.outcome IS NOT 'oom' \
       AND a.peak_allocated IS NOT NULL ORDER BY a.number DESC LIMIT 1) AS peak_allocated, \
    (SELECT a.peak_reserved FROM attempts a WHERE a.job_id = j.id AND a.outcome IS NOT 'oom' \
       AND a.peak_reserved IS NOT NULL ORDER BY a.number DESC LIMIT 1) AS peak_reserved, \
    (SELECT a.mean_tokens_per_s FROM attempts a WHERE a.job_id = j.id AND a.mean_tokens_per_s IS NOT NULL \
       ORDER BY a.number DESC LIMIT 1) AS mean_tokens_per_s \
    FROM jobs j";

impl Db {
    /// Open (creating if needed) and migrate. `path` ":memory:" gives a private in-memory DB.
    pub async fn open(path: &Path) -> DbResult<Db> {
        let url = format!("sqlite://{}", path.display());
        let opts = SqliteConnectOptions::from_str(&url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(2))
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(opts)
            .await?;
        let db = Db { pool, patience: REQUEST_PATIENCE };
        let pool = &db.pool;
        db.retry(
            "migrate",
            || async move { sqlx::migrate!("./migrations").run(pool).await.map_err(sqlx::Error::from) },
        )
        .await?;
        Ok(db)
    }

    /// The same database, waiting out busy errors for up to `patience` per query.
    pub fn with_patience(&self, patience: Duration) -> Db {
        Db { pool: self.pool.clone(), patience }
    }

    /// Run `op` again while it fails with a transient error (busy, locked), with exponential
    /// backoff and jitter, for up to `self.patience`; then the error.
    async fn retry<T, F, Fut>(&self, what: &str, mut op: F) -> DbResult<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = DbResult<T>>,
    {
        let start = Instant::now();
        let mut wait = Duration::from_millis(5);
        let mut warned = Duration::ZERO;
        loop {
            match op().await {
                Err(e) if is_transient(&e) && start.elapsed() < self.patience => {
                    let waited = start.elapsed();
                    if waited >= warned + Duration::from_secs(5) {
                        tracing::warn!("database busy for {:.1} s ({what}): {e}; retrying", waited.as_secs_f64());
                        warned = waited;
                    }
                    let jitter = Duration::from_micros(
                        u64::from(
                            std::time::SystemTime::now()
                                .duration_since(std::time::UNIX_EPOCH)
                                .unwrap_or_default()
                                .subsec_nanos(),
                        ) % 5_000,
                    );
                    tokio::time::sleep(wait + jitter).await;
                    wait = (wait * 2).min(Duration::from_millis(250));
                }
                result => return result,
            }
        }
    }

    /// A write transaction that takes the write lock when it begins (`BEGIN IMMEDIATE`): a
    /// deferred transaction that reads and then writes cannot be retried by SQLite's busy
    /// handler once another writer got in between.
    async fn write_tx(&self) -> DbResult<sqlx::Transaction<'static, sqlx::Sqlite>> {
        self.pool.begin_with("BEGIN IMMEDIATE").await
    }

    /// A new queued job and its `submitted` event, in one transaction.
    pub async fn create_job(&self, job: &NewJob<'_>) -> DbResult<i64> {
        self.retry("create_job", || async move {
            let t = now();
            let mut tx = self.write_tx().await?;
            let (id,): (i64,) = sqlx::query_as(
                "INSERT INTO jobs (name, policy, spec_yaml, current_spec, status, steps_requested, capacity, created_at, updated_at) \
                 VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?) RETURNING id",
            )
            .bind(job.name)
            .bind(job.policy)
            .bind(job.spec_yaml)
            .bind(job.current_spec)
            .bind(job.steps)
            .bind(job.capacity)
            .bind(t)
            .bind(t)
            .fetch_one(&mut *tx)
            .await?;
            sqlx::query("INSERT INTO events (job_id, attempt_id, t, kind, message) VALUES (?, NULL, ?, 'submitted', ?)")
                .bind(id)
                .bind(t)
                .bind(format!("job {} submitted with policy {}", job.name, job.policy))
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(id)
        })
        .await
    }

    pub async fn set_job_status(&self, id: i64, status: &str, reason: Option<&str>) -> DbResult<()> {
        self.retry("set_job_status", || async move {
            let t = now();
            let finished = matches!(status, "finished" | "failed" | "cancelled").then_some(t);
            sqlx::query(
                "UPDATE jobs SET status = ?, reason = COALESCE(?, reason), updated_at = ?, finished_at = ? WHERE id = ?",
            )
            .bind(status)
            .bind(reason)
            .bind(t)
            .bind(finished)
            .bind(id)
            .execute(&self.pool)
            .await?;
            Ok(())
        })
        .await
    }

    pub async fn set_job_rung(&self, id: i64, rung: &str, rung_index: i64, current_spec: &str) -> DbResult<()> {
        self.retry("set_job_rung", || async move {
            sqlx::query("UPDATE jobs SET rung = ?, rung_index = ?, current_spec = ?, updated_at = ? WHERE id = ?")
                .bind(rung)
                .bind(rung_index)
                .bind(current_spec)
                .bind(now())
                .bind(id)
                .execute(&self.pool)
                .await?;
            Ok(())
        })
        .await
    }

    pub async fn set_steps_done(&self, id: i64, steps: i64) -> DbResult<()> {
        self.retry("set_steps_done", || async move {
            sqlx::query("UPDATE jobs SET steps_done = MAX(steps_done, ?), updated_at = ? WHERE id = ?")
                .bind(steps)
                .bind(now())
                .bind(id)
                .execute(&self.pool)
                .await?;
            Ok(())
        })
        .await
    }

    pub async fn event(&self, job: i64, attempt: Option<i64>, kind: &str, message: &str) -> DbResult<i64> {
        self.retry("event", || async move {
            let row: (i64,) = sqlx::query_as(
                "INSERT INTO events (job_id, attempt_id, t, kind, message) VALUES (?, ?, ?, ?, ?) RETURNING id",
            )
            .bind(job)
            .bind(attempt)
            .bind(now())
            .bind(kind)
            .bind(message)
            .fetch_one(&self.pool)
            .await?;
            Ok(row.0)
        })
        .await
    }

    pub async fn start_attempt(
        &self,
        job: i64,
        rung: &str,
        config_json: &str,
        plan: &AttemptPlan,
    ) -> DbResult<(i64, i64)> {
        self.retry("start_attempt", || async move {
            let mut tx = self.write_tx().await?;
            let (n,): (i64,) =
                sqlx::query_as("SELECT COUNT(*) FROM attempts WHERE job_id = ?").bind(job).fetch_one(&mut *tx).await?;
            let (id,): (i64,) = sqlx::query_as(
                "INSERT INTO attempts (job_id, number, rung, config_json, started_at, device_kind, \
                 predicted_allocated, predicted_tokens_per_s, model_tokens_per_s, plan_json) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
            )
            .bind(job)
            .bind(n + 1)
            .bind(rung)
            .bind(config_json)
            .bind(now())
            .bind(&plan.device_kind)
            .bind(plan.predicted_allocated)
            .bind(plan.predicted_tokens_per_s)
            .bind(plan.model_tokens_per_s)
            .bind(&plan.plan_json)
            .fetch_one(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok((id, n + 1))
        })
        .await
    }

    pub async fn set_attempt_pid(&self, id: i64, pid: Option<u32>) -> DbResult<()> {
        self.retry("set_attempt_pid", || async move {
            sqlx::query("UPDATE attempts SET pid = ? WHERE id = ?")
                .bind(pid.map(i64::from))
                .bind(id)
                .execute(&self.pool)
                .await?;
            Ok(())
        })
        .await
    }

    pub async fn finish_attempt(&self, id: i64, end: &AttemptEnd) -> DbResult<()> {
        self.retry("finish_attempt", || async move {
            let p = &end.peaks;
            let oom = |i: usize| end.oom_at.map(|o| o[i]);
            sqlx::query(
                "UPDATE attempts SET ended_at = ?, outcome = ?, exit_code = ?, first_step = ?, last_step = ?, \
                 resumed_from_step = ?, capacity = ?, peak_params = ?, peak_grads = ?, peak_optimizer = ?, \
                 peak_activations = ?, peak_workspace = ?, peak_allocated = ?, peak_reserved = ?, \
                 mean_tokens_per_s = ?, oom_category = ?, oom_requested = ?, message = ?, oom_params = ?, \
                 oom_grads = ?, oom_optimizer = ?, oom_activations = ?, oom_workspace = ?, oom_reserved = ? WHERE id = ?",
            )
            .bind(now())
            .bind(&end.outcome)
            .bind(end.exit_code)
            .bind(end.first_step)
            .bind(end.last_step)
            .bind(end.resumed_from_step)
            .bind(end.capacity)
            .bind(p[0])
            .bind(p[1])
            .bind(p[2])
            .bind(p[3])
            .bind(p[4])
            .bind(p[5])
            .bind(p[6])
            .bind(end.mean_tokens_per_s)
            .bind(&end.oom_category)
            .bind(end.oom_requested)
            .bind(&end.message)
            .bind(oom(0))
            .bind(oom(1))
            .bind(oom(2))
            .bind(oom(3))
            .bind(oom(4))
            .bind(oom(5))
            .bind(id)
            .execute(&self.pool)
            .await?;
            Ok(())
        })
        .await
    }

    /// Write a batch of samples in one transaction.
    pub async fn insert_samples(&self, samples: &[SampleRow]) -> DbResult<()> {
        self.retry("insert_samples", || async move {
            if samples.is_empty() {
                return Ok(());
            }
            let mut tx = self.write_tx().await?;
            for s in samples {
                sqlx::query(
                    "INSERT INTO samples (attempt_id, step, t, loss, val_loss, tokens_per_s, step_ms, params, grads, \
                     optimizer, activations, workspace, allocated, reserved, fragmentation, capacity, at_peak_params, \
                     at_peak_grads, at_peak_optimizer, at_peak_activations, at_peak_workspace, at_peak_reserved) \
                     VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                )
                .bind(s.attempt_id)
                .bind(s.step)
                .bind(s.t)
                .bind(s.loss)
                .bind(s.val_loss)
                .bind(s.tokens_per_s)
                .bind(s.step_ms)
                .bind(s.params)
                .bind(s.grads)
                .bind(s.optimizer)
                .bind(s.activations)
                .bind(s.workspace)
                .bind(s.allocated)
                .bind(s.reserved)
                .bind(s.fragmentation)
                .bind(s.capacity)
                .bind(s.at_peak_params)
                .bind(s.at_peak_grads)
                .bind(s.at_peak_optimizer)
                .bind(s.at_peak_activations)
                .bind(s.at_peak_workspace)
                .bind(s.at_peak_reserved)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await
        })
        .await
    }

    /// One page of jobs, filtered and sorted; also the number of jobs matching the filter.
    pub async fn list_jobs(&self, f: &JobFilter) -> DbResult<(Vec<JobRow>, i64)> {
        self.retry("list_jobs", || async move {
            let mut conds = Vec::new();
            if f.status.is_some() {
                conds.push("j.status = ?");
            }
            if f.name_contains.is_some() {
                conds.push("instr(lower(j.name), lower(?)) > 0");
            }
            let filter = if conds.is_empty() { String::new() } else { format!(" WHERE {}", conds.join(" AND ")) };
            let order = format!("{} {}, j.id DESC", f.sort.column(), if f.descending { "DESC" } else { "ASC" });
            let sql = format!("{JOB_LIST_SELECT}{filter} ORDER BY {order} LIMIT ? OFFSET ?");
            let mut q = sqlx::query_as::<_, JobRow>(&sql);
            let count_sql = format!("SELECT COUNT(*) FROM jobs j{filter}");
            let mut cq = sqlx::query_as::<_, (i64,)>(&count_sql);
            if let Some(s) = &f.status {
                q = q.bind(s);
                cq = cq.bind(s);
            }
            if let Some(n) = &f.name_contains {
                q = q.bind(n);
                cq = cq.bind(n);
            }
            let rows = q.bind(f.limit).bind(f.offset).fetch_all(&self.pool).await?;
            let (total,) = cq.fetch_one(&self.pool).await?;
            Ok((rows, total))
        })
        .await
    }

    pub async fn count_jobs(&self) -> DbResult<Vec<(String, i64)>> {
        self.retry("count_jobs", || async move {
            sqlx::query_as("SELECT status, COUNT(*) FROM jobs GROUP BY status ORDER BY status")
                .fetch_all(&self.pool)
                .await
        })
        .await
    }

    pub async fn count_attempts(&self) -> DbResult<Vec<(String, i64)>> {
        self.retry("count_attempts", || async move {
            sqlx::query_as("SELECT COALESCE(outcome, 'running'), COUNT(*) FROM attempts GROUP BY 1 ORDER BY 1")
                .fetch_all(&self.pool)
                .await
        })
        .await
    }

    pub async fn job(&self, id: i64) -> DbResult<Option<JobDetail>> {
        self.retry("job", || async move {
            sqlx::query_as(
                "SELECT id, name, policy, status, rung, rung_index, steps_requested, steps_done, capacity, reason, \
                 created_at, updated_at, finished_at, spec_yaml, current_spec FROM jobs WHERE id = ?",
            )
            .bind(id)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    pub async fn attempts(&self, job: i64) -> DbResult<Vec<AttemptRow>> {
        self.retry("attempts", || async move {
            sqlx::query_as("SELECT * FROM attempts WHERE job_id = ? ORDER BY number")
                .bind(job)
                .fetch_all(&self.pool)
                .await
        })
        .await
    }

    pub async fn attempt(&self, id: i64) -> DbResult<Option<AttemptRow>> {
        self.retry("attempt", || async move {
            sqlx::query_as("SELECT * FROM attempts WHERE id = ?").bind(id).fetch_optional(&self.pool).await
        })
        .await
    }

    /// The newest `limit` ended attempts on `device_kind` that recorded a prediction.
    pub async fn device_history(&self, device_kind: &str, limit: i64) -> DbResult<Vec<HistoryRow>> {
        self.retry("device_history", || async move {
            sqlx::query_as(
                "SELECT outcome, predicted_allocated, peak_allocated, oom_requested, last_step, model_tokens_per_s, \
                 mean_tokens_per_s FROM attempts WHERE device_kind = ? AND ended_at IS NOT NULL \
                 AND predicted_allocated IS NOT NULL ORDER BY id DESC LIMIT ?",
            )
            .bind(device_kind)
            .bind(limit)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }

    /// (outcome, configuration) of job `job`'s attempts that ran out of memory, were preempted
    /// for their own memory (not for what other processes held: `OTHERS_MARK` in the message)
    /// or ran slow.
    pub async fn failed_configs(&self, job: i64) -> DbResult<Vec<(String, String)>> {
        self.retry("failed_configs", || async move {
            sqlx::query_as(
                "SELECT outcome, config_json FROM attempts WHERE job_id = ? AND (outcome IN ('oom', 'slow') \
                 OR (outcome = 'preempted' AND instr(coalesce(message, ''), ?) = 0)) ORDER BY id",
            )
            .bind(job)
            .bind(OTHERS_MARK)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }

    /// The newest finished jobs on `policy` other than `job` (warm-start candidates).
    pub async fn finished_jobs(&self, policy: &str, job: i64, limit: i64) -> DbResult<Vec<FinishedJob>> {
        self.retry("finished_jobs", || async move {
            sqlx::query_as(
                "SELECT id, policy, spec_yaml, current_spec, rung, rung_index FROM jobs \
                 WHERE status = 'finished' AND policy = ? AND id != ? ORDER BY id DESC LIMIT ?",
            )
            .bind(policy)
            .bind(job)
            .bind(limit)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }

    pub async fn samples(&self, job: i64) -> DbResult<Vec<SampleRow>> {
        self.retry("samples", || async move {
            sqlx::query_as(
                "SELECT s.* FROM samples s JOIN attempts a ON a.id = s.attempt_id WHERE a.job_id = ? ORDER BY s.t, s.step",
            )
            .bind(job)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }

    /// The newest `n` samples of a job, oldest first.
    pub async fn last_samples(&self, job: i64, n: i64) -> DbResult<Vec<SampleRow>> {
        let mut rows: Vec<SampleRow> = self
            .retry("last_samples", || async move {
                sqlx::query_as(
                    "SELECT s.* FROM samples s JOIN attempts a ON a.id = s.attempt_id WHERE a.job_id = ? \
                     ORDER BY s.t DESC, s.step DESC LIMIT ?",
                )
                .bind(job)
                .bind(n)
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        rows.reverse();
        Ok(rows)
    }

    pub async fn events(&self, job: i64, after: i64) -> DbResult<Vec<EventRow>> {
        self.retry("events", || async move {
            sqlx::query_as("SELECT * FROM events WHERE job_id = ? AND id > ? ORDER BY id")
                .bind(job)
                .bind(after)
                .fetch_all(&self.pool)
                .await
        })
        .await
    }

    /// This database's identity (random, made by migration 0002): run directories record it.
    pub async fn identity(&self) -> DbResult<String> {
        self.retry("identity", || async move {
            let (id,): (String,) =
                sqlx::query_as("SELECT value FROM meta WHERE key = 'db_id'").fetch_one(&self.pool).await?;
            Ok(id)
        })
        .await
    }

    /// Record a daemon start: a real write, so a database that cannot be written (a read-only
    /// file, a full disk) fails `serve` at once rather than every request after it.
    pub async fn record_start(&self) -> DbResult<()> {
        self.retry("record_start", || async move {
            sqlx::query("INSERT OR REPLACE INTO meta (key, value) VALUES ('last_start', ?)")
                .bind(now().to_string())
                .execute(&self.pool)
                .await?;
            Ok(())
        })
        .await
    }

    /// Pids of the trainers of attempts left open by a daemon that died.
    pub async fn dangling_attempt_pids(&self, job: i64) -> DbResult<Vec<i64>> {
        self.retry("dangling_attempt_pids", || async move {
            let rows: Vec<(i64,)> =
                sqlx::query_as("SELECT pid FROM attempts WHERE job_id = ? AND outcome IS NULL AND pid IS NOT NULL")
                    .bind(job)
                    .fetch_all(&self.pool)
                    .await?;
            Ok(rows.into_iter().map(|r| r.0).collect())
        })
        .await
    }

    /// Jobs a previous daemon left queued or running: to be resumed on start.
    pub async fn unfinished_jobs(&self) -> DbResult<Vec<i64>> {
        self.retry("unfinished_jobs", || async move {
            let rows: Vec<(i64,)> =
                sqlx::query_as("SELECT id FROM jobs WHERE status IN ('queued', 'running') ORDER BY id")
                    .fetch_all(&self.pool)
                    .await?;
            Ok(rows.into_iter().map(|r| r.0).collect())
        })
        .await
    }

    /// Attempts left open by a daemon that died: closed as crashed (their child is gone).
    pub async fn close_dangling_attempts(&self, job: i64) -> DbResult<()> {
        self.retry("close_dangling_attempts", || async move {
            sqlx::query(
                "UPDATE attempts SET ended_at = ?, outcome = 'crashed', message = 'supervisor restarted while running', \
                 first_step = (SELECT MIN(step) FROM samples WHERE attempt_id = attempts.id), \
                 last_step = (SELECT MAX(step) FROM samples WHERE attempt_id = attempts.id) \
                 WHERE job_id = ? AND outcome IS NULL",
            )
            .bind(now())
            .bind(job)
            .execute(&self.pool)
            .await?;
            Ok(())
        })
        .await
    }
}
