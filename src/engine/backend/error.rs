//! The backend's error type: OOM as a value, unsupported dtypes, shape and device errors.

use crate::memory::OomError;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Oom(#[from] OomError),
    #[error("{backend}: {op} does not support {dtype}")]
    Unsupported { backend: String, op: &'static str, dtype: &'static str },
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op} on {device}: {detail}")]
    Device { op: &'static str, device: String, detail: String },
}

pub type BackendResult<T = ()> = Result<T, BackendError>;

/// Fail with a shape error naming the op when `ok` is false.
pub fn check_shape(op: &'static str, ok: bool, detail: impl FnOnce() -> String) -> BackendResult {
    if ok {
        Ok(())
    } else {
        Err(BackendError::Shape { op, detail: detail() })
    }
}
