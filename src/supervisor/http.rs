//! The HTTP API (docs/DESIGN.md "HTTP API"): one AppState, a router per resource, one ApiError that
//! logs internals and never leaks them, bearer-token auth on mutating routes.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, Path as UrlPath, Query, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use crate::config::JobSpec;

use super::admission::{self, Machine};
use super::db::{self, Db, JobFilter, JobSort, NewJob};
use super::policy::{self, Policy, PolicyError};
use super::runner::Runner;

/// Largest request body accepted (job specs and policies are small).
pub const MAX_BODY: usize = 256 * 1024;

#[derive(Clone)]
pub struct AppState {
    pub db: Db,
    pub runner: Arc<Runner>,
    pub token: Option<String>,
    /// Directories a job's `data.path` must lie in (canonicalised).
    pub data_dirs: Vec<PathBuf>,
    /// NVML readings when a GPU driver is present.
    pub gpus: Arc<crate::gpu::GpuMonitor>,
    /// Turns true when the daemon shuts down: open event streams end.
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    /// What a submitted job is checked against (admission control).
    pub machine: Arc<Machine>,
}

/// How long a client may take to send a whole request body (a body that trickles in is cut
/// off with 408 rather than holding a connection and a task).
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long parsing and checking a submitted document may take.
const PARSE_TIMEOUT: Duration = Duration::from_secs(2);
/// Media types a job or policy body may be sent as (or none). Form and plain-text bodies are
/// refused: they are what a cross-site page can post without the browser asking first.
const BODY_TYPES: [&str; 5] =
    ["application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml", "application/json"];

/// Every error a handler returns. Internal details are logged, not sent.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("missing or wrong bearer token")]
    Unauthorized,
    #[error("{message}")]
    Rejected { status: StatusCode, message: String },
    /// The database stayed locked (by another process) for longer than a request waits.
    #[error("the experiment database is busy; retry shortly")]
    Busy,
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        if db::is_transient(&e) {
            tracing::warn!("database busy past the request's patience: {e}");
            return ApiError::Busy;
        }
        ApiError::Internal(e.into())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        ApiError::BadRequest(format!("query string: {}", r.body_text()))
    }
}

impl From<BytesRejection> for ApiError {
    fn from(r: BytesRejection) -> Self {
        let status = r.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!("request body larger than {MAX_BODY} bytes")
        } else {
            r.body_text()
        };
        ApiError::Rejected { status, message }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, message) = match &self {
            ApiError::BadRequest(m) => (StatusCode::BAD_REQUEST, m.clone()),
            ApiError::NotFound(m) => (StatusCode::NOT_FOUND, m.clone()),
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, self.to_string()),
            ApiError::Rejected { status, message } => (*status, message.clone()),
            ApiError::Busy => {
                let body = Json(json!({ "error": self.to_string() }));
                return (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, "5")], body).into_response();
            }
            ApiError::Internal(e) => {
                tracing::error!("internal error: {e:#}");
                (StatusCode::INTERNAL_SERVER_ERROR, "internal error".to_string())
            }
        };
        (status, Json(json!({ "error": message }))).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

pub fn router(state: AppState) -> Router {
    Router::new()
        .merge(jobs_router())
        .merge(policies_router())
        .route("/healthz", get(|| async { "ok" }))
        .route("/api/gpus", get(gpus))
        .route("/metrics", get(metrics))
        .merge(web_router())
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError::Rejected {
                status: StatusCode::METHOD_NOT_ALLOWED,
                message: format!("method {} is not allowed on {}", req.method(), req.uri().path()),
            }
        })
        .layer(middleware::from_fn_with_state(state.clone(), guard_mutations))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        // A declared length over the limit is refused before any body is read; a body that
        // trickles in is cut off (408) rather than holding a connection for ever.
        .layer(middleware::from_fn(refuse_declared_oversize))
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

/// The experiment-history page: static files embedded in the binary (no CDN, works offline).
fn web_router() -> Router<AppState> {
    fn asset(body: &'static str, content_type: &'static str) -> impl Fn() -> std::future::Ready<Response> + Clone {
        move || std::future::ready(([(header::CONTENT_TYPE, content_type)], body).into_response())
    }
    Router::new()
        .route("/", get(|| async { Html(include_str!("../../web/index.html")) }))
        .route("/app.js", get(asset(include_str!("../../web/app.js"), "text/javascript; charset=utf-8")))
        .route("/app.css", get(asset(include_str!("../../web/app.css"), "text/css; charset=utf-8")))
        .route(
            "/vendor/uPlot.iife.min.js",
            get(asset(include_str!("../../web/uPlot.iife.min.js"), "text/javascript; charset=utf-8")),
        )
        .route("/vendor/uPlot.min.css", get(asset(include_str!("../../web/uPlot.min.css"), "text/css; charset=utf-8")))
}

fn jobs_router() -> Router<AppState> {
    Router::new()
        .route("/api/jobs", post(submit_job).get(list_jobs))
        .route("/api/jobs/{id}", get(get_job))
        .route("/api/jobs/{id}/cancel", post(cancel_job))
        .route("/api/jobs/{id}/attempts", get(job_attempts))
        .route("/api/attempts/{id}", get(get_attempt))
        .route("/api/jobs/{id}/samples", get(job_samples))
        .route("/api/jobs/{id}/events", get(job_events))
}

fn policies_router() -> Router<AppState> {
    Router::new()
        .route("/api/policies", get(list_policies))
        .route("/api/policies/{name}", get(get_policy).put(put_policy))
}

/// Mutating routes: refused when a browser sends them from another origin (the `Origin`
/// header's host is not the `Host` this daemon was reached at), when the body's media type is
/// not YAML or JSON, and without `Authorization: Bearer TOKEN` when a token is configured.
async fn guard_mutations(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let mutating = matches!(*req.method(), Method::POST | Method::PUT | Method::DELETE | Method::PATCH);
    if !mutating {
        return next.run(req).await;
    }
    let headers = req.headers();
    let text = |name| headers.get(name).and_then(|v: &header::HeaderValue| v.to_str().ok());
    if let Some(origin) = text(header::ORIGIN) {
        let origin_host = origin.split_once("://").map_or(origin, |(_, rest)| rest).trim_end_matches('/');
        if Some(origin_host) != text(header::HOST) {
            return ApiError::Rejected {
                status: StatusCode::FORBIDDEN,
                message: format!("cross-origin request refused (Origin {origin})"),
            }
            .into_response();
        }
    }
    if let Some(token) = &state.token {
        let given = text(header::AUTHORIZATION).and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes())) {
            return ApiError::Unauthorized.into_response();
        }
    }
    if let Some(ct) = text(header::CONTENT_TYPE) {
        let media = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        if !BODY_TYPES.contains(&media.as_str()) {
            return ApiError::Rejected {
                status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
                message: format!("Content-Type {ct} is not accepted: send YAML or JSON ({})", BODY_TYPES.join(", ")),
            }
            .into_response();
        }
    }
    next.run(req).await
}

/// A request body read whole within [`BODY_TIMEOUT`] and [`MAX_BODY`].
struct BoundedBody(Bytes);

impl<S: Send + Sync> FromRequest<S> for BoundedBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match tokio::time::timeout(BODY_TIMEOUT, Bytes::from_request(req, state)).await {
            Ok(body) => Ok(BoundedBody(body?)),
            Err(_) => Err(ApiError::Rejected {
                status: StatusCode::REQUEST_TIMEOUT,
                message: format!("request body not received within {} s", BODY_TIMEOUT.as_secs()),
            }),
        }
    }
}

impl BoundedBody {
    /// The body as text (shared, so a parse off the runtime can hold it too).
    fn text(self) -> ApiResult<Arc<str>> {
        std::str::from_utf8(&self.0).map(Arc::from).map_err(|_| ApiError::BadRequest("body is not UTF-8".into()))
    }
}

/// 413 at once for a `Content-Length` above [`MAX_BODY`], before reading (or waiting for) it.
async fn refuse_declared_oversize(req: Request, next: Next) -> Response {
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return ApiError::Rejected {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("request body larger than {MAX_BODY} bytes"),
        }
        .into_response();
    }
    next.run(req).await
}

/// Equal bytes, in time that depends only on the lengths (a token compared byte by byte
/// would leak how much of a guess was right).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Run a parse of user input off the async workers, bounded in time.
async fn parse_off_runtime<T: Send + 'static>(
    what: &str,
    parse: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> ApiResult<T> {
    match tokio::time::timeout(PARSE_TIMEOUT, tokio::task::spawn_blocking(parse)).await {
        Ok(Ok(result)) => result.map_err(ApiError::BadRequest),
        Ok(Err(join)) => Err(ApiError::Internal(anyhow::anyhow!("parsing {what}: {join}"))),
        Err(_) => Err(ApiError::BadRequest(format!("{what}: took longer than {} s to parse", PARSE_TIMEOUT.as_secs()))),
    }
}

/// Resolve `data.path` and require it to lie inside one of the allowed data directories.
pub fn check_data_path(path: &Path, allowed: &[PathBuf]) -> Result<PathBuf, String> {
    let canonical = std::fs::canonicalize(path).map_err(|e| format!("data.path: {}: {e}", path.display()))?;
    if !canonical.is_file() {
        return Err(format!("data.path: {} is not a file", path.display()));
    }
    if !allowed.iter().any(|dir| canonical.starts_with(dir)) {
        let dirs: Vec<String> = allowed.iter().map(|d| d.display().to_string()).collect();
        return Err(format!(
            "data.path: {} is outside the allowed data directories ({})",
            path.display(),
            dirs.join(", ")
        ));
    }
    Ok(canonical)
}

async fn submit_job(State(state): State<AppState>, body: BoundedBody) -> ApiResult<impl IntoResponse> {
    let text = body.text()?;
    let (job, machine) = (text.clone(), state.machine.clone());
    let spec = parse_off_runtime("job", move || {
        let spec = JobSpec::parse(&job).map_err(|e| e.to_string())?;
        admission::admit(&spec, &machine)?;
        Ok(spec)
    })
    .await?;
    let policy = match policy::load(&state.runner.cfg.policies_dir, &spec.policy) {
        Ok((p, _)) => p,
        Err(PolicyError::NotFound(n)) => return Err(ApiError::BadRequest(format!("policy: `{n}` does not exist"))),
        Err(e) => return Err(ApiError::BadRequest(format!("policy `{}` cannot be used: {e}", spec.policy))),
    };
    let (mut spec, based) = policy::apply_base(&policy, &spec).map_err(|e| {
        ApiError::BadRequest(format!("policy `{}`: its base does not apply to this job: {e}", policy.name))
    })?;
    spec.data.path = check_data_path(&spec.data.path, &state.data_dirs).map_err(ApiError::BadRequest)?;
    let current = serde_json::to_string(&spec).map_err(anyhow::Error::from)?;
    let capacity = spec.device_capacity().map(|c| c as i64);
    let new = NewJob {
        name: &spec.name,
        policy: &spec.policy,
        spec_yaml: &text,
        current_spec: &current,
        steps: spec.train.steps,
        capacity,
    };
    let id = state.db.create_job(&new).await?;
    if let Some(message) = based {
        state.db.event(id, None, "base", &message).await?;
    }
    state.runner.enqueue(id);
    Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    status: Option<String>,
    /// Case-insensitive substring of the job name.
    q: Option<String>,
    sort: Option<String>,
    order: Option<String>,
    limit: Option<i64>,
    offset: Option<i64>,
}

/// A page of jobs; the total matching the filter is in the `X-Total-Count` header.
async fn list_jobs(
    State(state): State<AppState>,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> ApiResult<impl IntoResponse> {
    let Query(q) = q?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::BadRequest(format!("limit: {limit} must be in [1, 1000]")));
    }
    let sort = match q.sort.as_deref() {
        None | Some("") => JobSort::Id,
        Some(s) => serde_json::from_value(json!(s)).map_err(|_| {
            ApiError::BadRequest(format!(
                "sort: `{s}` is not one of id, name, status, policy, rung, attempts, steps_done, peak_reserved, \
                 mean_tokens_per_s, created_at, updated_at"
            ))
        })?,
    };
    let descending = match q.order.as_deref() {
        None | Some("") | Some("desc") => true,
        Some("asc") => false,
        Some(o) => return Err(ApiError::BadRequest(format!("order: `{o}` must be asc or desc"))),
    };
    const STATUSES: [&str; 5] = ["queued", "running", "finished", "failed", "cancelled"];
    if let Some(st) = q.status.as_deref().filter(|s| !s.is_empty() && !STATUSES.contains(s)) {
        return Err(ApiError::BadRequest(format!("status: `{st}` is not one of {}", STATUSES.join(", "))));
    }
    let filter = JobFilter {
        status: q.status.filter(|s| !s.is_empty()),
        name_contains: q.q.filter(|s| !s.is_empty()),
        sort,
        descending,
        limit,
        offset: q.offset.unwrap_or(0).max(0),
    };
    let (jobs, total) = state.db.list_jobs(&filter).await?;
    Ok(([("x-total-count", total.to_string())], Json(jobs)))
}

fn parse_id(raw: &str) -> ApiResult<i64> {
    raw.parse::<i64>().map_err(|_| ApiError::BadRequest(format!("job id `{raw}` is not an integer")))
}

async fn existing_job(state: &AppState, raw: &str) -> ApiResult<super::db::JobDetail> {
    let id = parse_id(raw)?;
    state.db.job(id).await?.ok_or_else(|| ApiError::NotFound(format!("job {id} does not exist")))
}

async fn get_job(State(state): State<AppState>, UrlPath(id): UrlPath<String>) -> ApiResult<impl IntoResponse> {
    Ok(Json(existing_job(&state, &id).await?))
}

async fn cancel_job(State(state): State<AppState>, UrlPath(id): UrlPath<String>) -> ApiResult<impl IntoResponse> {
    let job = existing_job(&state, &id).await?;
    let accepted = state.runner.cancel(job.core.id).await?;
    if !accepted {
        return Err(ApiError::Rejected {
            status: StatusCode::CONFLICT,
            message: format!("job {} is {} and cannot be cancelled", job.core.id, job.core.status),
        });
    }
    Ok((StatusCode::ACCEPTED, Json(json!({ "id": job.core.id, "cancelling": true }))))
}

/// One attempt by its id (it names its `job_id`): what compare fetches for each column.
async fn get_attempt(State(state): State<AppState>, UrlPath(raw): UrlPath<String>) -> ApiResult<impl IntoResponse> {
    let id = raw.parse::<i64>().map_err(|_| ApiError::BadRequest(format!("attempt id `{raw}` is not an integer")))?;
    let attempt = state.db.attempt(id).await?;
    Ok(Json(attempt.ok_or_else(|| ApiError::NotFound(format!("attempt {id} does not exist")))?))
}

async fn job_attempts(State(state): State<AppState>, UrlPath(id): UrlPath<String>) -> ApiResult<impl IntoResponse> {
    let job = existing_job(&state, &id).await?;
    Ok(Json(state.db.attempts(job.core.id).await?))
}

#[derive(Debug, Deserialize)]
struct SamplesQuery {
    /// Only the newest `last` samples (a follower's progress line needs one).
    last: Option<i64>,
}

async fn job_samples(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
    q: Result<Query<SamplesQuery>, QueryRejection>,
) -> ApiResult<impl IntoResponse> {
    let Query(q) = q?;
    let job = existing_job(&state, &id).await?;
    match q.last {
        None => Ok(Json(state.db.samples(job.core.id).await?)),
        Some(n @ 1..=10_000) => Ok(Json(state.db.last_samples(job.core.id, n).await?)),
        Some(n) => Err(ApiError::BadRequest(format!("last: {n} must be in [1, 10000]"))),
    }
}

#[derive(Debug, Deserialize)]
struct EventsQuery {
    after: Option<i64>,
}

/// Events as JSON, or as a server-sent event stream when the client accepts text/event-stream
/// (the stream ends once the job is finished, failed or cancelled and every event was sent).
async fn job_events(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
    q: Result<Query<EventsQuery>, QueryRejection>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let Query(q) = q?;
    let job = existing_job(&state, &id).await?;
    let after = q.after.unwrap_or(0);
    let wants_stream =
        headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(|v| v.contains("text/event-stream"));
    if !wants_stream {
        return Ok(Json(state.db.events(job.core.id, after).await?).into_response());
    }
    let db = state.db.clone();
    let job_id = job.core.id;
    let shutdown = state.shutdown.clone();
    let stream = futures::stream::unfold((db, after, false), move |(db, last, done)| {
        let mut shutdown = shutdown.clone();
        async move {
            if done || *shutdown.borrow() {
                return None;
            }
            loop {
                let events = db.events(job_id, last).await.unwrap_or_default();
                if !events.is_empty() {
                    let new_last = events.last().map(|e| e.id).unwrap_or(last);
                    let items: Vec<Result<Event, Infallible>> = events
                        .iter()
                        .map(|e| {
                            Ok(Event::default().id(e.id.to_string()).event(e.kind.clone()).json_data(e).expect("json"))
                        })
                        .collect();
                    return Some((futures::stream::iter(items), (db, new_last, false)));
                }
                let terminal = matches!(
                    db.job(job_id).await.ok().flatten().map(|j| j.core.status).as_deref(),
                    Some("finished" | "failed" | "cancelled") | None
                );
                if terminal {
                    let end = vec![Ok(Event::default().event("end").data("{}"))];
                    return Some((futures::stream::iter(end), (db, last, true)));
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                    _ = shutdown.wait_for(|s| *s) => return None,
                }
            }
        }
    });
    let flat = futures::StreamExt::flatten(stream);
    Ok(Sse::new(flat).keep_alive(KeepAlive::default()).into_response())
}

async fn list_policies(State(state): State<AppState>) -> ApiResult<impl IntoResponse> {
    let dir = &state.runner.cfg.policies_dir;
    let mut out = Vec::new();
    for name in policy::list(dir) {
        match policy::load(dir, &name) {
            Ok((p, _)) => out.push(json!({
                "name": p.name,
                "thresholds": p.thresholds,
                "rungs": p.rungs.iter().map(|r| r.name.clone()).collect::<Vec<_>>(),
            })),
            Err(e) => out.push(json!({ "name": name, "error": e.to_string() })),
        }
    }
    Ok(Json(out))
}

async fn get_policy(State(state): State<AppState>, UrlPath(name): UrlPath<String>) -> ApiResult<impl IntoResponse> {
    match policy::load(&state.runner.cfg.policies_dir, &name) {
        Ok((p, yaml)) => Ok(Json(json!({ "name": p.name, "yaml": yaml, "policy": p }))),
        Err(PolicyError::NotFound(n)) => Err(ApiError::NotFound(format!("policy `{n}` does not exist"))),
        Err(e @ PolicyError::Invalid { .. }) => Err(ApiError::BadRequest(e.to_string())),
        Err(e) => Err(ApiError::Internal(e.into())),
    }
}

async fn put_policy(
    State(state): State<AppState>,
    UrlPath(name): UrlPath<String>,
    body: BoundedBody,
) -> ApiResult<impl IntoResponse> {
    if !policy::valid_name(&name) {
        return Err(ApiError::BadRequest(format!("policy name `{name}` must match [A-Za-z0-9_-]{{1,64}}")));
    }
    let text = body.text()?;
    let yaml = text.clone();
    let p = parse_off_runtime("policy", move || Policy::parse(&yaml).map_err(|e| e.to_string())).await?;
    if p.name != name {
        return Err(ApiError::BadRequest(format!("name: `{}` does not match the URL's `{name}`", p.name)));
    }
    let dir = &state.runner.cfg.policies_dir;
    let path = dir.join(format!("{name}.yaml"));
    let tmp = dir.join(format!(".{name}.yaml.tmp"));
    std::fs::write(&tmp, &*text).and_then(|_| std::fs::rename(&tmp, &path)).map_err(anyhow::Error::from)?;
    Ok(Json(json!({ "name": name, "rungs": p.rungs.len() })))
}

/// NVML readings of every GPU (an empty list without a driver).
async fn gpus(State(state): State<AppState>) -> Json<Vec<crate::gpu::GpuReading>> {
    Json(state.gpus.readings())
}

async fn metrics(State(state): State<AppState>) -> ApiResult<impl IntoResponse> {
    let mut out = String::new();
    out.push_str("# HELP headroom_jobs Jobs in the experiment database by status.\n# TYPE headroom_jobs gauge\n");
    for (status, n) in state.db.count_jobs().await? {
        out.push_str(&format!("headroom_jobs{{status=\"{status}\"}} {n}\n"));
    }
    out.push_str("# HELP headroom_attempts Trainer attempts by outcome.\n# TYPE headroom_attempts gauge\n");
    for (outcome, n) in state.db.count_attempts().await? {
        out.push_str(&format!("headroom_attempts{{outcome=\"{outcome}\"}} {n}\n"));
    }
    out.push_str("# HELP headroom_nvml_available Whether NVML (GPU monitoring) could be loaded.\n# TYPE headroom_nvml_available gauge\n");
    out.push_str(&format!("headroom_nvml_available {}\n", u8::from(state.gpus.available())));
    let readings = state.gpus.readings();
    if !readings.is_empty() {
        out.push_str("# HELP headroom_gpu_memory_used_bytes GPU memory in use (NVML).\n# TYPE headroom_gpu_memory_used_bytes gauge\n");
        for r in &readings {
            out.push_str(&format!("headroom_gpu_memory_used_bytes{{gpu=\"{}\"}} {}\n", r.index, r.used_bytes));
        }
        out.push_str("# HELP headroom_gpu_memory_total_bytes GPU memory capacity (NVML).\n# TYPE headroom_gpu_memory_total_bytes gauge\n");
        for r in &readings {
            out.push_str(&format!("headroom_gpu_memory_total_bytes{{gpu=\"{}\"}} {}\n", r.index, r.total_bytes));
        }
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out))
}
