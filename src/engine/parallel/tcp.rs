//! Ranks as processes: the rendezvous that joins them (rank 0 listens, the others connect and
//! are checked against its job) and `TcpLink`, the star of TCP connections — every rank to
//! rank 0 — that carries their collectives. Rank 0 reduces in rank order, so a process group's
//! results are bitwise those of a thread group (`comm::Group::threads`).
//!
//! A star costs rank 0 `world` times each buffer per collective: it is the transport of the
//! `cpu` device and of the control traffic (scalars, shard ranges); on GPUs the gradients go
//! through NCCL. A connection that fails mid-collective ends this rank's process (exit 1, the
//! peer named on stderr): its peers then see their own connection close and end too, so no
//! rank waits forever for one that is gone, and the job resumes from its last checkpoint.
//! A rank that fails on its own (out of memory, say) first sends rank 0 its last words
//! ([`RankFailure`]: exit code, message, `oom` line); rank 0 ends the process with them —
//! when it next reads from that rank, or when its own connections close in the cascade — so
//! the supervisor sees that rank's OOM, not a lost connection.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::engine::backend::layers::Elem;
use crate::protocol::ExitCode;

/// Changes whenever the wire form of the handshake or of a collective changes.
const WIRE_VERSION: u32 = 2;
/// The largest handshake message accepted (a job spec and a session, in JSON).
const MAX_HANDSHAKE: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// A rank that belongs to another job, another world or a duplicate rank: retrying cannot help.
    #[error("rendezvous at {addr}: {message}")]
    Refused { addr: String, message: String },
    #[error(
        "rendezvous at {addr}: {joined} of {world} ranks joined within {}s (missing: {missing:?})",
        waited.as_secs()
    )]
    Timeout { addr: String, world: usize, joined: usize, missing: Vec<usize>, waited: Duration },
    #[error("rendezvous at {addr}: {message}")]
    Io { addr: String, message: String },
    /// The launcher's check on its rank processes failed while waiting (one exited early).
    #[error("rendezvous at {addr}: {message}")]
    Abandoned { addr: String, message: String },
}

impl RendezvousError {
    /// Refusals are the configuration's fault (exit 2); the rest are the machine's (exit 1).
    pub fn exit_code(&self) -> ExitCode {
        match self {
            RendezvousError::Refused { .. } => ExitCode::Invalid,
            _ => ExitCode::Internal,
        }
    }
}

/// What a joining rank says about itself.
#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    wire: u32,
    rank: usize,
    world: usize,
    /// The job as this rank read it (compact JSON): every rank must run the same job.
    job: String,
}

/// Rank 0's answer: refused with a reason, or admitted with the session every rank shares.
#[derive(Debug, Serialize, Deserialize)]
enum Welcome {
    Refused(String),
    Admitted(serde_json::Value),
}

/// One rank's connections: rank 0 holds one per other rank (`peers[r - 1]`), the others one
/// to rank 0 (`peers[0]`). Each collective is called by one thread of the rank at a time.
pub struct TcpLink {
    rank: usize,
    world: usize,
    peers: Vec<Mutex<TcpStream>>,
    /// The link this one was split from, at the top (the whole group's): where a failing rank
    /// reports to rank 0. None: this is it.
    root: Option<Arc<TcpLink>>,
    /// How the process ends once the group is broken (tests unwind instead).
    end: fn(RankFailure) -> !,
}

/// A rank's last words, relayed to rank 0 before it ends: what rank 0 then ends the job with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankFailure {
    pub rank: usize,
    /// The protocol exit code the process ends with.
    pub code: i32,
    pub message: String,
    /// A protocol line for rank 0 to write first (the failed rank's `oom` event).
    pub line: Option<String>,
}

/// The length word that announces a failure report instead of a collective's data.
const FAILURE_FRAME: u64 = u64::MAX;
/// The largest failure report accepted.
const MAX_FAILURE: u64 = 1 << 20;
/// How long rank 0, its connection to a rank lost, looks on each of its peers for a report of
/// a failure sent before that rank ended.
const REPORT_WAIT: Duration = Duration::from_millis(200);

/// End this process with `failure`: its protocol line on stdout (for the supervisor), its
/// message on stderr — printed, not logged: the attempt's last word whatever the log level.
fn end_process(failure: RankFailure) -> ! {
    if let Some(line) = &failure.line {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
    eprintln!("{}", failure.message);
    std::process::exit(failure.code);
}

impl TcpLink {
    /// Rank 0's side: admit `world - 1` ranks on `listener`, each checked against `job`, and
    /// send each the `session`. `alive` is asked between connections (the launcher's check on
    /// the processes it started); an error from it abandons the rendezvous.
    pub fn host<S: Serialize>(
        listener: TcpListener,
        world: usize,
        job: &str,
        session: &S,
        timeout: Duration,
        alive: &mut dyn FnMut() -> Result<(), String>,
    ) -> Result<TcpLink, RendezvousError> {
        let addr = listener.local_addr().map_or_else(|_| "?".to_string(), |a| a.to_string());
        let io = |e: std::io::Error| RendezvousError::Io { addr: addr.clone(), message: e.to_string() };
        let session = serde_json::to_value(session).expect("the session serialises");
        listener.set_nonblocking(true).map_err(io)?;
        let mut joined: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
        let start = Instant::now();
        while joined.iter().any(Option::is_none) {
            alive().map_err(|message| RendezvousError::Abandoned { addr: addr.clone(), message })?;
            let mut stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if start.elapsed() > timeout {
                        let missing: Vec<usize> =
                            joined.iter().enumerate().filter(|(_, s)| s.is_none()).map(|(i, _)| i + 1).collect();
                        return Err(RendezvousError::Timeout {
                            addr,
                            world,
                            joined: world - missing.len(),
                            missing,
                            waited: timeout,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => return Err(io(e)),
            };
            stream.set_nonblocking(false).map_err(io)?;
            stream.set_nodelay(true).map_err(io)?;
            // A connection that says nothing in time is dropped, not waited for.
            stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(io)?;
            let hello: Hello = match read_frame(&mut stream, MAX_HANDSHAKE)
                .and_then(|b| serde_json::from_slice(&b).map_err(std::io::Error::other))
            {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!("rendezvous at {addr}: dropped a connection that sent no valid greeting: {e}");
                    continue;
                }
            };
            let refusal = if hello.wire != WIRE_VERSION {
                Some(format!("rank {} speaks wire version {}, rank 0 {WIRE_VERSION}", hello.rank, hello.wire))
            } else if hello.world != world {
                Some(format!("rank {} has world size {}, rank 0 {world}", hello.rank, hello.world))
            } else if hello.rank == 0 || hello.rank >= world {
                Some(format!("rank {} is not in 1..{world}", hello.rank))
            } else if joined[hello.rank - 1].is_some() {
                Some(format!("rank {} joined twice", hello.rank))
            } else if hello.job != job {
                Some(format!(
                    "rank {} runs another job spec than rank 0 (every rank must read the same job)",
                    hello.rank
                ))
            } else {
                None
            };
            if let Some(message) = refusal {
                let _ = write_frame(&mut stream, &serde_json::to_vec(&Welcome::Refused(message.clone())).unwrap());
                return Err(RendezvousError::Refused { addr, message });
            }
            write_frame(&mut stream, &serde_json::to_vec(&Welcome::Admitted(session.clone())).unwrap()).map_err(io)?;
            stream.set_read_timeout(None).map_err(io)?;
            joined[hello.rank - 1] = Some(stream);
        }
        Ok(TcpLink {
            rank: 0,
            world,
            peers: joined.into_iter().map(|s| Mutex::new(s.expect("joined"))).collect(),
            root: None,
            end: end_process,
        })
    }

    /// Rank `rank`'s side: connect to rank 0 at `addr` (retrying until it listens, up to
    /// `timeout`), introduce this rank and its `job`, and receive the session.
    pub fn join<S: DeserializeOwned>(
        addr: &str,
        rank: usize,
        world: usize,
        job: &str,
        timeout: Duration,
    ) -> Result<(TcpLink, S), RendezvousError> {
        let io = |e: std::io::Error| RendezvousError::Io { addr: addr.to_string(), message: e.to_string() };
        let start = Instant::now();
        let mut stream = loop {
            let tried = addr.to_socket_addrs().and_then(|mut addrs| {
                let a = addrs.next().ok_or_else(|| std::io::Error::other("the address resolves to nothing"))?;
                TcpStream::connect_timeout(&a, Duration::from_secs(5))
            });
            match tried {
                Ok(s) => break s,
                Err(e) if start.elapsed() > timeout => {
                    return Err(RendezvousError::Io {
                        addr: addr.into(),
                        message: format!("rank 0 did not answer within {}s ({e})", timeout.as_secs()),
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        stream.set_nodelay(true).map_err(io)?;
        let hello = Hello { wire: WIRE_VERSION, rank, world, job: job.into() };
        write_frame(&mut stream, &serde_json::to_vec(&hello).expect("hello serialises")).map_err(io)?;
        let welcome: Welcome = read_frame(&mut stream, MAX_HANDSHAKE)
            .and_then(|b| serde_json::from_slice(&b).map_err(std::io::Error::other))
            .map_err(io)?;
        match welcome {
            Welcome::Refused(message) => Err(RendezvousError::Refused { addr: addr.into(), message }),
            Welcome::Admitted(session) => {
                let session = serde_json::from_value(session).map_err(|e| RendezvousError::Io {
                    addr: addr.into(),
                    message: format!("rank 0's session: {e}"),
                })?;
                Ok((TcpLink { rank, world, peers: vec![Mutex::new(stream)], root: None, end: end_process }, session))
            }
        }
    }

    /// `Group::split` for a process group: the sub-group of the ranks giving `color`, its
    /// first rank hosting a rendezvous on the interface its own connection uses (so the others
    /// reach it wherever they reach this group), its address sent through this group.
    pub fn split(self: &Arc<Self>, color: u64, timeout: Duration) -> Result<TcpLink, RendezvousError> {
        let mut sub = self.split_link(color, timeout)?;
        sub.root = Some(self.root.clone().unwrap_or_else(|| self.clone()));
        sub.end = self.end;
        Ok(sub)
    }

    fn split_link(&self, color: u64, timeout: Duration) -> Result<TcpLink, RendezvousError> {
        let colors: Vec<u64> = self.exchange_words(&[color]).into_iter().map(|w| w[0]).collect();
        let members: Vec<usize> = (0..self.world).filter(|&r| colors[r] == color).collect();
        let (sub_rank, sub_world) = (members.iter().position(|&r| r == self.rank).expect("a member"), members.len());
        let hosting = sub_rank == 0 && sub_world > 1;
        let listener = if hosting {
            let here = self.peers[0].lock().unwrap_or_else(|e| e.into_inner()).local_addr().map(|a| a.ip());
            Some(here.and_then(|ip| TcpListener::bind((ip, 0))))
        } else {
            None
        };
        let listening = match &listener {
            Some(Ok(l)) => l.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            _ => String::new(),
        };
        let addresses = self.exchange_words(&address_words(&listening));
        // The same text on every member: the rendezvous checks it like a job spec.
        let job = format!("split of {} ranks, color {color}", self.world);
        if sub_world == 1 {
            return Ok(TcpLink { rank: 0, world: 1, peers: Vec::new(), root: None, end: end_process });
        }
        match listener {
            Some(Ok(listener)) => TcpLink::host(listener, sub_world, &job, &(), timeout, &mut || Ok(())),
            Some(Err(e)) => Err(RendezvousError::Io { addr: "split".into(), message: format!("cannot listen: {e}") }),
            None => {
                let at = words_address(&addresses[members[0]]);
                if at.is_empty() {
                    return Err(RendezvousError::Io {
                        addr: "split".into(),
                        message: format!("rank {} could not listen for its sub-group", members[0]),
                    });
                }
                TcpLink::join::<()>(&at, sub_rank, sub_world, &job, timeout).map(|(link, ())| link)
            }
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// The rank at the other end of `peers[i]`.
    fn peer_rank(&self, i: usize) -> usize {
        if self.rank == 0 {
            i + 1
        } else {
            0
        }
    }

    /// A connection failed mid-collective: this rank cannot go on, and must not leave its
    /// peers waiting, so the process ends (its sockets close, which ends theirs) — with the
    /// failure a rank reported before it ended, where rank 0 finds one.
    fn lost(&self, i: usize, e: std::io::Error) -> ! {
        let message = format!(
            "rank {}: the connection to rank {} failed ({e}); ending this rank (the job resumes from its last checkpoint)",
            self.rank,
            self.peer_rank(i)
        );
        let lost = RankFailure { rank: self.rank, code: ExitCode::Internal.code(), message, line: None };
        (self.end)(self.root().reported_failure().unwrap_or(lost))
    }

    /// The whole group's link (this one, unless it was split from another).
    fn root(&self) -> &TcpLink {
        self.root.as_deref().unwrap_or(self)
    }

    /// This rank failed outside the collectives and is about to end: tell rank 0 of the whole
    /// group why ([`RankFailure`]), so the job ends with it. Rank 0 says it itself.
    pub fn report_failure(&self, failure: &RankFailure) {
        let root = self.root();
        if root.rank == 0 || root.peers.is_empty() {
            return;
        }
        let mut s = root.peers[0].lock().unwrap_or_else(|e| e.into_inner());
        let bytes = serde_json::to_vec(failure).expect("a failure serialises");
        let sent = s.write_all(&FAILURE_FRAME.to_le_bytes()).and_then(|()| write_frame(&mut s, &bytes));
        if let Err(e) = sent {
            tracing::warn!("could not report this rank's failure to rank 0: {e}");
        }
    }

    /// On rank 0 of the whole group: a failure some rank reported before its connection
    /// closed, read from what its peers have sent (data frames of a collective this rank did
    /// not reach are passed over).
    fn reported_failure(&self) -> Option<RankFailure> {
        if self.rank != 0 {
            return None;
        }
        for peer in &self.peers {
            // A connection in use by a collective on another thread is not this one's to read.
            let Ok(mut s) = peer.try_lock() else { continue };
            if s.set_read_timeout(Some(REPORT_WAIT)).is_err() {
                continue;
            }
            let found = loop {
                match read_len(&mut s) {
                    Ok(FAILURE_FRAME) => break read_failure(&mut s).ok(),
                    Ok(len) => match std::io::copy(&mut (&mut *s).take(len), &mut std::io::sink()) {
                        Ok(n) if n == len => continue,
                        _ => break None,
                    },
                    Err(_) => break None,
                }
            };
            let _ = s.set_read_timeout(None);
            if found.is_some() {
                return found;
            }
        }
        None
    }

    fn send(&self, i: usize, bytes: &[u8]) {
        let mut s = self.peers[i].lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = write_frame(&mut s, bytes) {
            drop(s);
            self.lost(i, e);
        }
    }

    /// Receive a frame of exactly `into.len()` bytes (or a peer's failure report, which ends
    /// the process with it).
    fn recv_into(&self, i: usize, into: &mut [u8]) {
        let mut s = self.peers[i].lock().unwrap_or_else(|e| e.into_inner());
        match read_frame_into(&mut s, into) {
            Ok(None) => {}
            Ok(Some(failure)) => {
                drop(s);
                (self.end)(failure)
            }
            Err(e) => {
                drop(s);
                self.lost(i, e);
            }
        }
    }

    fn send_elems<E: bytemuck::Pod>(&self, i: usize, v: &[E]) {
        self.send(i, bytemuck::cast_slice(v));
    }

    fn recv_elems<E: bytemuck::Pod>(&self, i: usize, v: &mut [E]) {
        self.recv_into(i, bytemuck::cast_slice_mut(v));
    }

    /// Every rank's `words` (the same count on every rank), in rank order, on every rank.
    pub fn exchange_words(&self, words: &[u64]) -> Vec<Vec<u64>> {
        let n = words.len();
        let mut all = vec![0u64; n * self.world];
        if self.rank == 0 {
            all[..n].copy_from_slice(words);
            for i in 0..self.world - 1 {
                self.recv_elems(i, &mut all[(i + 1) * n..(i + 2) * n]);
            }
            for i in 0..self.world - 1 {
                self.send_elems(i, &all);
            }
        } else {
            self.send_elems(0, words);
            self.recv_elems(0, &mut all);
        }
        all.chunks(n.max(1)).map(<[u64]>::to_vec).take(self.world).collect()
    }

    /// Rank 0's side of a reduction: `mine` plus every other rank's buffer of the same
    /// length, added in rank order in f32 from zero (as a thread group adds).
    fn sum_in_rank_order<E: Elem>(&self, mine: &[E]) -> Vec<f32> {
        let mut sum = vec![0f32; mine.len()];
        add_into(&mut sum, mine);
        let mut theirs = vec![E::default(); mine.len()];
        for i in 0..self.world - 1 {
            self.recv_elems(i, &mut theirs);
            add_into(&mut sum, &theirs);
        }
        sum
    }

    /// Every rank's shard `own`, in rank order, on every rank.
    pub fn owners(&self, own: &Range<usize>) -> Vec<Range<usize>> {
        let words = self.exchange_words(&[own.start as u64, own.end as u64]);
        words.into_iter().map(|w| w[0] as usize..w[1] as usize).collect()
    }

    /// `Comm::all_reduce_sum`: rank 0 sums every rank's buffer in rank order (f32, from zero)
    /// and sends the sum back.
    pub fn all_reduce_sum<E: Elem>(&self, buf: &mut [E]) {
        if self.rank != 0 {
            self.send_elems(0, buf);
            self.recv_elems(0, buf);
            return;
        }
        let sum = self.sum_in_rank_order(buf);
        for (b, s) in buf.iter_mut().zip(&sum) {
            *b = E::from_f32(*s);
        }
        for i in 0..self.world - 1 {
            self.send_elems(i, buf);
        }
    }

    /// `Comm::all_gather`: rank 0 collects each rank's shard into its buffer and sends it all.
    pub fn all_gather<E: Elem>(&self, buf: &mut [E], own: Range<usize>) {
        let owners = self.owners(&own);
        if self.rank != 0 {
            self.send_elems(0, &buf[own]);
            self.recv_elems(0, buf);
            return;
        }
        for (r, theirs) in owners.into_iter().enumerate().skip(1) {
            self.recv_elems(r - 1, &mut buf[theirs]);
        }
        for i in 0..self.world - 1 {
            self.send_elems(i, buf);
        }
    }

    /// `Comm::reduce_scatter_add`: rank 0 sums the buckets in rank order (f32) and sends each
    /// rank the sums of its part, which it adds into its shard.
    pub fn reduce_scatter_add<E: Elem>(&self, bucket: &[E], offset: usize, shard: &mut [E], own: Range<usize>) {
        let owners = self.owners(&own);
        let range = offset..offset + bucket.len();
        let p = part_of(&owners[self.rank], &range);
        let mut mine = vec![0f32; p.len()];
        if self.rank != 0 {
            self.send_elems(0, bucket);
            self.recv_elems(0, &mut mine);
        } else {
            let sum = self.sum_in_rank_order(bucket);
            for (r, theirs) in owners.iter().enumerate() {
                let q = part_of(theirs, &range);
                let sums = if q.is_empty() { &[][..] } else { &sum[q.start - offset..q.end - offset] };
                if r == 0 {
                    mine.copy_from_slice(sums);
                } else {
                    self.send_elems(r - 1, sums);
                }
            }
        }
        if !p.is_empty() {
            for (d, s) in shard[p.start - own.start..p.end - own.start].iter_mut().zip(&mine) {
                *d = E::from_f32(d.to_f32() + s);
            }
        }
    }

    /// `Comm::gather_range`: rank 0 assembles `offset..offset + out.len()` from each owner's
    /// part and sends it to every rank.
    pub fn gather_range<E: Elem>(&self, shard: &[E], own: Range<usize>, offset: usize, out: &mut [E]) {
        let owners = self.owners(&own);
        let range = offset..offset + out.len();
        let p = part_of(&owners[self.rank], &range);
        let mine = if p.is_empty() { &[][..] } else { &shard[p.start - own.start..p.end - own.start] };
        if self.rank != 0 {
            self.send_elems(0, mine);
            self.recv_elems(0, out);
            return;
        }
        if !p.is_empty() {
            out[p.start - offset..p.end - offset].copy_from_slice(mine);
        }
        for (r, w) in owners.iter().enumerate().skip(1) {
            let p = part_of(w, &range);
            let into = if p.is_empty() { &mut [][..] } else { &mut out[p.start - offset..p.end - offset] };
            self.recv_elems(r - 1, into);
        }
        for i in 0..self.world - 1 {
            self.send_elems(i, out);
        }
    }
}

/// The part of an owner's shard inside `range`; `0..0` when they do not meet.
fn part_of(owner: &Range<usize>, range: &Range<usize>) -> Range<usize> {
    let (lo, hi) = (owner.start.max(range.start), owner.end.min(range.end));
    if lo < hi {
        lo..hi
    } else {
        0..0
    }
}

/// `sum[i] += v[i]` in f32.
fn add_into<E: Elem>(sum: &mut [f32], v: &[E]) {
    for (s, x) in sum.iter_mut().zip(v) {
        *s += x.to_f32();
    }
}

/// A frame: its length (u64, little-endian), then the bytes.
fn write_frame(s: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    s.write_all(&(bytes.len() as u64).to_le_bytes())?;
    s.write_all(bytes)
}

fn read_len(s: &mut TcpStream) -> std::io::Result<u64> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    Ok(u64::from_le_bytes(len))
}

fn read_frame(s: &mut TcpStream, max: u64) -> std::io::Result<Vec<u8>> {
    let len = read_len(s)?;
    if len > max {
        return Err(std::io::Error::other(format!("a frame of {len} bytes (at most {max} expected)")));
    }
    let mut bytes = vec![0u8; len as usize];
    s.read_exact(&mut bytes)?;
    Ok(bytes)
}

/// A frame that must be exactly `into.len()` bytes (both sides run the same collective), or
/// the peer's failure report in its place.
fn read_frame_into(s: &mut TcpStream, into: &mut [u8]) -> std::io::Result<Option<RankFailure>> {
    let len = read_len(s)?;
    if len == FAILURE_FRAME {
        return read_failure(s).map(Some);
    }
    if len != into.len() as u64 {
        return Err(std::io::Error::other(format!(
            "a frame of {len} bytes where {} were expected (the ranks are out of step)",
            into.len()
        )));
    }
    s.read_exact(into)?;
    Ok(None)
}

/// The report that follows a [`FAILURE_FRAME`] word.
fn read_failure(s: &mut TcpStream) -> std::io::Result<RankFailure> {
    serde_json::from_slice(&read_frame(s, MAX_FAILURE)?).map_err(std::io::Error::other)
}

/// Words of a socket address's text (up to 64 bytes; an IPv6 address with its port fits).
const ADDRESS_WORDS: usize = 8;

fn address_words(address: &str) -> [u64; ADDRESS_WORDS] {
    let mut bytes = [0u8; ADDRESS_WORDS * 8];
    let n = address.len().min(bytes.len());
    bytes[..n].copy_from_slice(&address.as_bytes()[..n]);
    let mut words = [0u64; ADDRESS_WORDS];
    for (w, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
        *w = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
    }
    words
}

fn words_address(words: &[u64]) -> String {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `world` links joined over loopback, in rank order (rank 0 hosts on a thread of its own).
    pub(crate) fn loopback(world: usize) -> Vec<TcpLink> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let host = std::thread::spawn(move || {
            TcpLink::host(listener, world, "job", &"session", Duration::from_secs(20), &mut || Ok(())).unwrap()
        });
        let mut links: Vec<TcpLink> = (1..world)
            .map(|rank| {
                let (link, session): (TcpLink, String) =
                    TcpLink::join(&addr, rank, world, "job", Duration::from_secs(20)).unwrap();
                assert_eq!(session, "session");
                link
            })
            .collect();
        links.insert(0, host.join().unwrap());
        links
    }

    #[test]
    fn a_rank_of_another_job_or_world_is_refused_naming_why() {
        for (world, job, expected) in [
            (2, "other job", "rank 1 runs another job spec than rank 0"),
            (3, "job", "rank 1 has world size 3, rank 0 2"),
        ] {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let host = std::thread::spawn(move || {
                TcpLink::host(listener, 2, "job", &(), Duration::from_secs(20), &mut || Ok(())).err().unwrap()
            });
            let joined = TcpLink::join::<()>(&addr, 1, world, job, Duration::from_secs(20)).err().unwrap();
            let hosted = host.join().unwrap();
            for err in [joined, hosted] {
                assert!(matches!(err, RendezvousError::Refused { .. }), "{err}");
                assert!(err.to_string().contains(expected), "{err}");
                assert_eq!(err.exit_code(), ExitCode::Invalid);
            }
        }
    }

    #[test]
    fn a_rendezvous_that_misses_a_rank_times_out_naming_it() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let err = TcpLink::host(listener, 3, "job", &(), Duration::from_millis(200), &mut || Ok(())).err().unwrap();
        assert!(matches!(&err, RendezvousError::Timeout { missing, .. } if *missing == vec![1, 2]), "{err}");
        // The launcher's check stops the wait at once.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let err = TcpLink::host(listener, 2, "job", &(), Duration::from_secs(60), &mut || Err("rank 1 exited".into()))
            .err()
            .unwrap();
        assert!(err.to_string().ends_with("rank 1 exited"), "{err}");
    }

    /// Tests end a rank by unwinding with its failure instead of ending the process.
    fn unwind(failure: RankFailure) -> ! {
        std::panic::resume_unwind(Box::new(failure))
    }

    /// `loopback(world)`, each link ending its rank by unwinding.
    fn unwinding_loopback(world: usize) -> Vec<Arc<TcpLink>> {
        loopback(world)
            .into_iter()
            .map(|mut l| {
                l.end = unwind;
                Arc::new(l)
            })
            .collect()
    }

    /// What `f` ended the rank with (it must end it).
    fn ended_with(f: impl FnOnce()) -> RankFailure {
        let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("the rank ended");
        *payload.downcast::<RankFailure>().expect("ended by the link")
    }

    /// A rank that fails outside the collectives reports why before it ends; rank 0 ends with
    /// that report — read in place of the rank's data in a collective of the whole group, or
    /// found on its connections once a sub-group's connection to that rank closes — and the
    /// others, their connection to rank 0 gone, end as lost (exit 1).
    #[test]
    fn a_failed_rank_s_report_ends_rank_0_with_its_code_and_line() {
        let report = |rank: usize| RankFailure {
            rank,
            code: ExitCode::OutOfMemory.code(),
            message: format!("rank {rank} failed: out of memory"),
            line: Some(format!("{{\"t\":1.0,\"event\":\"oom\",\"rank\":{rank}}}")),
        };
        // In a collective of the whole group.
        let links = unwinding_loopback(3);
        let [l0, l1, l2]: [Arc<TcpLink>; 3] = links.try_into().ok().unwrap();
        let waiting = std::thread::spawn(move || ended_with(|| l2.all_reduce_sum(&mut [1.0f32; 4])));
        l1.report_failure(&report(1));
        drop(l1);
        assert_eq!(ended_with(|| l0.all_reduce_sum(&mut [1.0f32; 4])), report(1));
        drop(l0);
        let lost = waiting.join().unwrap();
        assert_eq!((lost.rank, lost.code), (2, ExitCode::Internal.code()), "{lost:?}");
        assert!(lost.message.contains("the connection to rank 0 failed"), "{}", lost.message);

        // In a sub-group: rank 0 and rank 2 split off, rank 2 fails, rank 1 waits in the whole group.
        let links = unwinding_loopback(3);
        let splits: Vec<TcpLink> = std::thread::scope(|scope| {
            let splits: Vec<_> = links
                .iter()
                .map(|l| {
                    scope.spawn(move || l.split(if l.rank() == 1 { 1 } else { 0 }, Duration::from_secs(20)).unwrap())
                })
                .collect();
            splits.into_iter().map(|j| j.join().unwrap()).collect()
        });
        // Each rank's only handles on its links: dropping them closes its connections.
        let subs: Vec<(Arc<TcpLink>, TcpLink)> = links.into_iter().zip(splits).collect();
        let [(l0, s0), (l1, s1), (l2, s2)]: [(Arc<TcpLink>, TcpLink); 3] = subs.try_into().ok().unwrap();
        assert_eq!((s0.rank(), s0.world(), s2.rank(), s1.world()), (0, 2, 1, 1));
        let waiting = std::thread::spawn(move || ended_with(|| l1.all_reduce_sum(&mut [1.0f32; 4])));
        s2.report_failure(&report(2));
        drop((s2, l2));
        assert_eq!(ended_with(|| s0.all_reduce_sum(&mut [1.0f32; 4])), report(2));
        drop((s0, l0));
        assert_eq!(waiting.join().unwrap().code, ExitCode::Internal.code());
    }
}
