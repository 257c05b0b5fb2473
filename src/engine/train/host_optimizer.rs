//! The host optimizer's memory (`offload.optimizer: cpu`): fp32 master weights and AdamW
//! moments in host memory, the buffers gradients and weights cross the link through
//! (page-locked where the backend gains from it), and — with `offload.delayed_update` — the
//! update of the last step, running on its own thread while the device computes this one.
//!
//! The delayed update (DeepSpeed's DPU): step n's forward and backward run on the weights of
//! update n−2 while update n−1 runs on the host; at the end of step n the host waits for
//! update n−1, sends its weights to the device and starts update n on step n's gradients. The
//! gradients applied are therefore one step stale. `settle` drains the pipeline (checkpoints,
//! evaluations), so a run resumed from a checkpoint continues exactly as the original did.

use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::engine::backend::layers::Elem;
use crate::engine::backend::{BackendResult, HostPin};

/// Master weights, moments and the link buffer of the shard a rank owns.
pub(super) struct HostState<E> {
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// In: a step's gradients (the storage type, as they leave the device); out: the updated
    /// weights, narrowed, as they go back.
    pub io: Vec<E>,
}

struct Slot<E> {
    /// None while a delayed update owns it.
    state: Option<HostState<E>>,
    in_flight: Option<JoinHandle<HostState<E>>>,
    /// A finished delayed update's weights (in `io`) have not gone to the device yet.
    weights_due: bool,
}

impl<E> Slot<E> {
    fn state(&mut self) -> &mut HostState<E> {
        if let Some(update) = self.in_flight.take() {
            self.state = Some(update.join().expect("the host update does not panic"));
            self.weights_due = true;
        }
        self.state.as_mut().expect("the state is home when no update is in flight")
    }
}

/// What waiting on and sending a delayed update cost the step.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Delayed {
    /// Time the step waited for the last update to finish.
    pub waited: Duration,
    /// Its weights sent to the device: bytes, and the time it took.
    pub sent_bytes: usize,
    pub sent: Duration,
}

pub(super) struct HostOptimizer<E> {
    /// Page-locks of `io` and `next` (declared first: released before the memory is freed).
    _pins: Vec<HostPin>,
    slot: Mutex<Slot<E>>,
    /// Delayed update: where this step's gradients land while the last step's update runs on
    /// `io` (empty otherwise).
    next: Vec<E>,
    delayed: bool,
}

impl<E: Elem> HostOptimizer<E> {
    /// State for `master` (its moments zero); `pin` page-locks each link buffer.
    pub fn new(master: Vec<f32>, delayed: bool, mut pin: impl FnMut(&mut [u8]) -> HostPin) -> Self {
        let k = master.len();
        let mut io = vec![E::default(); k];
        let mut next = vec![E::default(); if delayed { k } else { 0 }];
        let pins = vec![pin(bytemuck::cast_slice_mut(&mut io)), pin(bytemuck::cast_slice_mut(&mut next))];
        let state = HostState { master, m: vec![0.0; k], v: vec![0.0; k], io };
        HostOptimizer {
            _pins: pins,
            slot: Mutex::new(Slot { state: Some(state), in_flight: None, weights_due: false }),
            next,
            delayed,
        }
    }

    pub fn delayed(&self) -> bool {
        self.delayed
    }

    /// `f` on the state, once an update in flight has finished (its weights stay due for the
    /// device: reading does not change what the run computes).
    pub fn with_state<R>(&self, f: impl FnOnce(&mut HostState<E>) -> R) -> R {
        let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        f(slot.state())
    }

    /// The state, for the synchronous step (no update is in flight there).
    pub fn state_mut(&mut self) -> &mut HostState<E> {
        self.slot.get_mut().unwrap_or_else(|p| p.into_inner()).state()
    }

    /// Where this step's gradients land: beside the update in flight (a delayed step), or in
    /// `io`.
    pub fn landing(&mut self, delayed_step: bool) -> &mut [E] {
        if delayed_step {
            &mut self.next
        } else {
            &mut self.state_mut().io
        }
    }

    /// The delayed step: wait for the last update, `send` its weights to the device, and start
    /// this step's (`update`, on the gradients that landed in `next`) on its own thread.
    pub fn start_delayed(
        &mut self,
        send: impl FnOnce(&[E]) -> BackendResult<usize>,
        update: impl FnOnce(&mut HostState<E>) + Send + 'static,
    ) -> BackendResult<Delayed> {
        let cost = self.settle(send)?;
        let slot = self.slot.get_mut().unwrap_or_else(|p| p.into_inner());
        let mut state = slot.state.take().expect("settled");
        // The gradients go to the update; the buffer its weights were sent from takes the
        // next step's.
        std::mem::swap(&mut state.io, &mut self.next);
        slot.in_flight = Some(std::thread::spawn(move || {
            update(&mut state);
            state
        }));
        Ok(cost)
    }

    /// Drain the pipeline: wait for the update in flight and `send` its weights, so the device
    /// holds the latest ones (before a checkpoint or an evaluation).
    pub fn settle(&mut self, send: impl FnOnce(&[E]) -> BackendResult<usize>) -> BackendResult<Delayed> {
        let slot = self.slot.get_mut().unwrap_or_else(|p| p.into_inner());
        let started = Instant::now();
        slot.state();
        let mut cost = Delayed { waited: started.elapsed(), ..Delayed::default() };
        if std::mem::take(&mut slot.weights_due) {
            let started = Instant::now();
            cost.sent_bytes = send(&slot.state().io)?;
            cost.sent = started.elapsed();
        }
        Ok(cost)
    }

    /// Forget the update in flight (its result is about to be overwritten: a restore).
    pub fn discard(&mut self) {
        let slot = self.slot.get_mut().unwrap_or_else(|p| p.into_inner());
        slot.state();
        slot.weights_due = false;
    }
}

impl<E> Drop for HostOptimizer<E> {
    fn drop(&mut self) {
        // The update owns buffers the pins lock: let it finish first.
        if let Some(update) = self.slot.get_mut().map(|s| s.in_flight.take()).unwrap_or(None) {
            let _ = update.join();
        }
    }
}
