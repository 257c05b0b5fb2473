//! How an attempt ended: the child's exit status, what the supervisor asked of it and what the
//! monitor saw, classified into an [`Outcome`] (docs/DESIGN.md "Exit codes"). The leaf both the
//! monitor and the ladder decision read.

use crate::protocol::ExitCode;

/// A supervisor event to record: (DB event kind, message).
pub type Notice = (&'static str, String);

/// Why the monitor stopped an attempt, once it did.
#[derive(Debug, Clone, PartialEq)]
pub enum StopReason {
    /// Memory above the preempt threshold for `sustain` steps.
    Pressure(String),
    /// Offload transfers above the policy's `swap_bound` for `sustain` steps.
    SwapBound(String),
    /// Memory other processes held is free again: stopped to step back up (the reason).
    StepUp(String),
    /// Throughput far below the plan's prediction for `sustain` steps.
    Slow(String),
    /// Nothing heard from the trainer for the policy's `stall` limit: killed.
    Stalled(String),
}

/// How one child process ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Finished,
    Oom {
        category: String,
        requested: i64,
    },
    /// Checkpointed and stopped by the monitor above the preempt threshold.
    Preempted {
        reason: String,
    },
    /// Checkpointed and stopped: offload transfers took more than the policy's `swap_bound`.
    SwapBound {
        reason: String,
    },
    /// Checkpointed and stopped to step back up to a better configuration, the memory other
    /// processes took being free again.
    SteppedUp {
        reason: String,
    },
    /// Checkpointed and stopped: its tokens/s stayed far below what the plan predicted.
    Slow {
        reason: String,
    },
    /// Checkpointed and stopped because the daemon is shutting down.
    Suspended,
    Cancelled,
    /// Exit 2: the configuration is unusable; retrying cannot help.
    Invalid {
        message: String,
    },
    Crashed {
        message: String,
    },
    /// Killed by the supervisor: nothing heard from it for the policy's `stall` limit (a hang).
    /// Retried from the newest checkpoint as a crash is.
    Stalled {
        reason: String,
    },
}

impl Outcome {
    /// The attempt row's `outcome` column.
    pub fn db_name(&self) -> &'static str {
        match self {
            Outcome::Finished => "finished",
            Outcome::Oom { .. } => "oom",
            Outcome::Preempted { .. } | Outcome::Suspended => "preempted",
            Outcome::SwapBound { .. } => "swap_bound",
            Outcome::SteppedUp { .. } => "stepped_up",
            Outcome::Slow { .. } => "slow",
            Outcome::Cancelled => "cancelled",
            Outcome::Invalid { .. } | Outcome::Crashed { .. } => "crashed",
            Outcome::Stalled { .. } => "stalled",
        }
    }
}

/// What the supervisor asked of a running attempt, besides the monitor's preemption.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    Cancel,
    Shutdown,
}

/// What the runner knows when a child has exited.
#[derive(Debug, Clone, PartialEq)]
pub struct Exit {
    /// The exit status's code (None: killed by a signal, described in `signal`).
    pub code: Option<i32>,
    pub signal: String,
    pub requested: Option<Request>,
    /// Why the monitor preempted it, if it did.
    pub stopped_by_monitor: Option<StopReason>,
    /// From the trainer's `oom` event: (category, requested bytes).
    pub oom: (String, i64),
    /// The last line of the attempt's log (the trainer's error message).
    pub last_log_line: String,
}

/// The outcome of an exited attempt.
pub fn classify(exit: &Exit) -> Outcome {
    let code = exit.code.map(|c| ExitCode::from_code(c).ok_or(c));
    // Killed for stalling (unless it finished on its own first): what was asked of it decides.
    if let (Some(StopReason::Stalled(reason)), false) = (&exit.stopped_by_monitor, exit.code == Some(0)) {
        return match exit.requested {
            Some(Request::Cancel) => Outcome::Cancelled,
            Some(Request::Shutdown) => Outcome::Suspended,
            None => Outcome::Stalled { reason: reason.clone() },
        };
    }
    match (code, exit.requested) {
        (Some(Ok(ExitCode::Finished)), _) => Outcome::Finished,
        (Some(Ok(ExitCode::OutOfMemory)), _) => Outcome::Oom { category: exit.oom.0.clone(), requested: exit.oom.1 },
        (Some(Ok(ExitCode::Preempted)), Some(Request::Cancel)) => Outcome::Cancelled,
        (Some(Ok(ExitCode::Preempted)), Some(Request::Shutdown)) => Outcome::Suspended,
        (Some(Ok(ExitCode::Preempted)), None) => match &exit.stopped_by_monitor {
            Some(StopReason::SwapBound(reason)) => Outcome::SwapBound { reason: reason.clone() },
            Some(StopReason::Pressure(reason)) => Outcome::Preempted { reason: reason.clone() },
            Some(StopReason::StepUp(reason)) => Outcome::SteppedUp { reason: reason.clone() },
            Some(StopReason::Slow(reason)) => Outcome::Slow { reason: reason.clone() },
            Some(StopReason::Stalled(_)) => unreachable!("classified above"),
            None => Outcome::Preempted { reason: "trainer stopped itself after a checkpoint".into() },
        },
        (Some(Ok(ExitCode::Invalid)), _) => Outcome::Invalid { message: exit.last_log_line.clone() },
        // Internal (1), or a code the protocol does not define: the same crash, the raw code named.
        (Some(_), _) => {
            Outcome::Crashed { message: format!("exit code {}: {}", exit.code.unwrap_or_default(), exit.last_log_line) }
        }
        (None, _) => Outcome::Crashed { message: format!("killed by a signal ({})", exit.signal) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_classify_as_the_protocol_says() {
        let exit = |code: Option<i32>, requested, monitor| Exit {
            code,
            signal: "signal: 9 (SIGKILL)".into(),
            requested,
            stopped_by_monitor: monitor,
            oom: ("optimizer".into(), 4096),
            last_log_line: "error: boom".into(),
        };
        let pressure = Some(StopReason::Pressure("at 97%".into()));
        let swap = Some(StopReason::SwapBound("80%".into()));
        let stalled = Some(StopReason::Stalled("quiet 600 s".into()));
        let cases = [
            (exit(Some(0), None, None), Outcome::Finished),
            (exit(Some(3), None, None), Outcome::Oom { category: "optimizer".into(), requested: 4096 }),
            (exit(Some(4), Some(Request::Cancel), pressure.clone()), Outcome::Cancelled),
            (exit(Some(4), Some(Request::Shutdown), None), Outcome::Suspended),
            (exit(Some(4), None, pressure), Outcome::Preempted { reason: "at 97%".into() }),
            (exit(Some(4), None, swap), Outcome::SwapBound { reason: "80%".into() }),
            (
                exit(Some(4), None, Some(StopReason::StepUp("freed".into()))),
                Outcome::SteppedUp { reason: "freed".into() },
            ),
            (
                exit(Some(4), None, Some(StopReason::Slow("3k < 10k".into()))),
                Outcome::Slow { reason: "3k < 10k".into() },
            ),
            (
                exit(Some(4), None, None),
                Outcome::Preempted { reason: "trainer stopped itself after a checkpoint".into() },
            ),
            (exit(Some(2), None, None), Outcome::Invalid { message: "error: boom".into() }),
            (exit(Some(1), None, None), Outcome::Crashed { message: "exit code 1: error: boom".into() }),
            (exit(Some(101), None, None), Outcome::Crashed { message: "exit code 101: error: boom".into() }),
            (exit(None, None, None), Outcome::Crashed { message: "killed by a signal (signal: 9 (SIGKILL))".into() }),
            (exit(None, None, stalled.clone()), Outcome::Stalled { reason: "quiet 600 s".into() }),
            (exit(Some(1), None, stalled.clone()), Outcome::Stalled { reason: "quiet 600 s".into() }),
            (exit(None, Some(Request::Cancel), stalled.clone()), Outcome::Cancelled),
            (exit(None, Some(Request::Shutdown), stalled.clone()), Outcome::Suspended),
            (exit(Some(0), None, stalled), Outcome::Finished),
        ];
        for (exit, want) in cases {
            assert_eq!(classify(&exit), want, "{exit:?}");
        }
    }
}
