//! What the client sends on each channel — requests, data, EOF, close — queued in order for the
//! channel's task, bounded in bytes, and the one place where the gateway pushes back on a client.
//!
//! russh grants a client more window as soon as data *arrives*, not when it is consumed, so the
//! only way to slow a client down is to stop reading its connection: the handler awaits
//! [`ChannelInput::push`] when too much is queued. That pauses every channel of the connection,
//! including the processing of the client's `WINDOW_ADJUST`s, which sit behind the data in the
//! TCP stream. If some channel's output is meanwhile waiting for exactly such an adjustment (or
//! for the connection's outbox, which the paused loop no longer empties), waiting would
//! deadlock the connection: a process like `cat` stops reading its input while its output is
//! blocked. So there are two sets of limits:
//!
//! - while no output of the connection is stalled, [`SOFT_LIMIT`] per channel and
//!   [`CONNECTION_SOFT_LIMIT`] per connection: beyond them the handler waits (an upload to a
//!   slow disk is paced at the disk's speed, and meanwhile the connection's other channels wait
//!   for their input too);
//! - while some output is stalled, the handler never waits, so the adjustment gets through,
//!   up to [`HARD_LIMIT`] per channel and [`CONNECTION_HARD_LIMIT`] per connection: a channel
//!   that would go beyond (its client keeps sending but does not read) is closed with an error
//!   instead of growing without bound or wedging the connection.
//!
//! Output counts as stalled once a send towards the client has waited [`STALL_AFTER`]
//! ([`ChannelInput::stalled`], held by the sender while it waits).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use russh::{ChannelId, Sig};
use tokio::sync::Notify;

use crate::requests::{Answer, ChannelKind, Request, RequestGate};

/// Bytes queued on one channel before the handler waits, while no output is stalled.
pub const SOFT_LIMIT: usize = 2 * 1024 * 1024;
/// Bytes queued on all channels of a connection before the handler waits, while no output is
/// stalled.
pub const CONNECTION_SOFT_LIMIT: usize = 8 * 1024 * 1024;
/// Bytes queued on one channel while some output of the connection is stalled; beyond this
/// the channel is closed.
pub const HARD_LIMIT: usize = 32 * 1024 * 1024;
/// Bytes queued on all channels of a connection while some output is stalled; a channel that
/// would go beyond is closed.
pub const CONNECTION_HARD_LIMIT: usize = 64 * 1024 * 1024;
/// A send towards the client that has not completed after this long counts as stalled.
pub const STALL_AFTER: Duration = Duration::from_millis(50);
/// What a request counts for against the limits.
const REQUEST_SIZE: usize = 64;

/// One thing the client sent on a channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    Request(Request),
    Data(Vec<u8>),
    Eof,
    /// The client closed the channel (russh already answered with its own close).
    Close,
    /// The client sent more than [`HARD_LIMIT`] ahead of the process: close the channel.
    Overflowed,
}

impl Input {
    fn size(&self) -> usize {
        match self {
            Input::Data(data) => data.len(),
            Input::Request(_) => REQUEST_SIZE,
            Input::Eof | Input::Close | Input::Overflowed => 0,
        }
    }
}

/// Why [`ChannelInput::push`] did not queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushError {
    /// The channel's task is gone: drop what the client sends.
    Gone,
    /// More than [`HARD_LIMIT`] queued while output was stalled: the channel is being closed.
    Overflow,
}

/// What the channels of one connection share: stalled outputs and queued bytes.
#[derive(Debug, Default)]
pub struct ConnectionInput {
    stalled: AtomicUsize,
    queued: AtomicUsize,
    /// Wakes the producer: output stalled or recovered, or some queue shrank.
    changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    items: VecDeque<Input>,
    bytes: usize,
    /// The channel's task stopped reading.
    closed: bool,
    /// No more input will come (the connection ended).
    finished: bool,
    overflowed: bool,
}

/// The input queue of one channel: the handler pushes, the channel's task receives.
#[derive(Debug)]
pub struct ChannelInput {
    state: Mutex<State>,
    /// Wakes the consumer.
    item: Notify,
    connection: Arc<ConnectionInput>,
    /// The requests granted so far (only the handler uses it).
    requests: Mutex<RequestGate>,
}

impl ChannelInput {
    pub fn new(connection: Arc<ConnectionInput>, kind: ChannelKind) -> Self {
        Self {
            state: Mutex::new(State::default()),
            item: Notify::new(),
            connection,
            requests: Mutex::new(RequestGate::new(kind)),
        }
    }

    /// The gateway's answer to `request` on this channel (see `requests.rs`).
    pub fn answer(&self, request: &Request) -> Answer {
        self.requests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .answer(request)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes `bytes` off the queue's and the connection's count and wakes the producer.
    fn release(&self, state: &mut State, bytes: usize) {
        state.bytes -= bytes;
        self.connection.queued.fetch_sub(bytes, Ordering::SeqCst);
        self.connection.changed.notify_waiters();
    }

    /// Queues `input`, waiting while too much is queued and no output of the connection is
    /// stalled (see the module doc).
    pub async fn push(&self, input: Input) -> Result<(), PushError> {
        let size = input.size();
        let connection = &self.connection;
        loop {
            // Registered before looking, so no change between the look and the wait is missed.
            let changed = connection.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut state = self.lock();
                if state.closed || state.finished {
                    return Err(PushError::Gone);
                }
                if state.overflowed {
                    return Err(PushError::Overflow);
                }
                let stalled = connection.stalled.load(Ordering::SeqCst) > 0;
                let (limit, connection_limit) = if stalled {
                    (HARD_LIMIT, CONNECTION_HARD_LIMIT)
                } else {
                    (SOFT_LIMIT, CONNECTION_SOFT_LIMIT)
                };
                let queued = connection.queued.load(Ordering::SeqCst);
                let fits = size == 0
                    || ((state.bytes == 0 || state.bytes + size <= limit)
                        && (queued == 0 || queued + size <= connection_limit));
                if fits {
                    state.bytes += size;
                    connection.queued.fetch_add(size, Ordering::SeqCst);
                    state.items.push_back(input);
                    drop(state);
                    self.item.notify_one();
                    return Ok(());
                }
                if stalled {
                    state.overflowed = true;
                    state.items.clear();
                    let bytes = state.bytes;
                    self.release(&mut state, bytes);
                    drop(state);
                    self.item.notify_one();
                    return Err(PushError::Overflow);
                }
            }
            changed.await;
        }
    }

    /// The next input, in order; `None` once the connection ended and everything was taken.
    pub async fn recv(&self) -> Option<Input> {
        loop {
            {
                let mut state = self.lock();
                if state.overflowed {
                    state.overflowed = false;
                    state.closed = true;
                    return Some(Input::Overflowed);
                }
                if let Some(item) = state.items.pop_front() {
                    self.release(&mut state, item.size());
                    return Some(item);
                }
                if state.finished || state.closed {
                    return None;
                }
            }
            self.item.notified().await;
        }
    }

    /// The channel's task is done: whatever comes next is dropped.
    pub fn close(&self) {
        let mut state = self.lock();
        state.closed = true;
        state.items.clear();
        let bytes = state.bytes;
        self.release(&mut state, bytes);
    }

    /// The connection ended: no more input; the consumer drains what is queued.
    pub fn finish(&self) {
        self.lock().finished = true;
        self.item.notify_one();
        self.connection.changed.notify_waiters();
    }

    /// Marks this channel's output as stalled until the guard is dropped.
    pub fn stalled(&self) -> StallGuard<'_> {
        self.connection.stalled.fetch_add(1, Ordering::SeqCst);
        self.connection.changed.notify_waiters();
        StallGuard { input: self }
    }
}

/// Held while a send towards the client is stalled.
#[derive(Debug)]
pub struct StallGuard<'a> {
    input: &'a ChannelInput,
}

impl Drop for StallGuard<'_> {
    fn drop(&mut self) {
        let connection = &self.input.connection;
        connection.stalled.fetch_sub(1, Ordering::SeqCst);
        connection.changed.notify_waiters();
    }
}

/// The input queues of one connection's open channels, shared by the handler (which fills
/// them) and the connection task (which registers them).
#[derive(Debug, Default)]
pub struct ChannelTable {
    inputs: Mutex<HashMap<ChannelId, Arc<ChannelInput>>>,
    connection: Arc<ConnectionInput>,
    /// Set once the connection ended: nothing is registered any more.
    finished: AtomicBool,
}

impl ChannelTable {
    fn lock(&self) -> MutexGuard<'_, HashMap<ChannelId, Arc<ChannelInput>>> {
        self.inputs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new queue for `channel` of `kind`; register it before accepting the channel.
    pub fn register(&self, channel: ChannelId, kind: ChannelKind) -> Arc<ChannelInput> {
        let input = Arc::new(ChannelInput::new(self.connection.clone(), kind));
        if self.finished.load(Ordering::SeqCst) {
            input.finish();
        } else {
            self.lock().insert(channel, input.clone());
        }
        input
    }

    pub fn get(&self, channel: ChannelId) -> Option<Arc<ChannelInput>> {
        self.lock().get(&channel).cloned()
    }

    /// Forgets `channel`'s queue if it is still `input`.
    pub fn remove(&self, channel: ChannelId, input: &Arc<ChannelInput>) {
        let mut inputs = self.lock();
        if inputs.get(&channel).is_some_and(|i| Arc::ptr_eq(i, input)) {
            inputs.remove(&channel);
        }
    }

    /// The connection ended: every queue is finished and forgotten.
    pub fn finish_all(&self) {
        self.finished.store(true, Ordering::SeqCst);
        for (_, input) in self.lock().drain() {
            input.finish();
        }
    }
}

/// SSH's name of a signal (without `SIG`), as the stream protocol carries it.
pub fn signal_name(signal: &Sig) -> String {
    match signal {
        Sig::ABRT => "ABRT",
        Sig::ALRM => "ALRM",
        Sig::FPE => "FPE",
        Sig::HUP => "HUP",
        Sig::ILL => "ILL",
        Sig::INT => "INT",
        Sig::KILL => "KILL",
        Sig::PIPE => "PIPE",
        Sig::QUIT => "QUIT",
        Sig::SEGV => "SEGV",
        Sig::TERM => "TERM",
        Sig::USR1 => "USR1",
        Sig::Custom(name) => name.as_str(),
    }
    .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Input {
        Input::Data(vec![0; n])
    }

    #[tokio::test(start_paused = true)]
    async fn order_is_kept_and_the_producer_waits_beyond_the_soft_limit() {
        let input = Arc::new(ChannelInput::new(Arc::default(), ChannelKind::Session));
        input.push(Input::Request(Request::Shell)).await.unwrap();
        input.push(data(SOFT_LIMIT - 200)).await.unwrap();
        input.push(data(50)).await.unwrap();
        // Over the limit: the push waits until the consumer takes something.
        let pushing = tokio::spawn({
            let input = input.clone();
            async move { input.push(data(1000)).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!pushing.is_finished());
        assert_eq!(input.recv().await, Some(Input::Request(Request::Shell)));
        assert!(!pushing.is_finished(), "a request frees too little");
        assert_eq!(input.recv().await, Some(data(SOFT_LIMIT - 200)));
        pushing.await.unwrap().unwrap();
        assert_eq!(input.recv().await, Some(data(50)));
        assert_eq!(input.recv().await, Some(data(1000)));
        // EOF and close always fit.
        input.push(data(SOFT_LIMIT)).await.unwrap();
        input.push(Input::Eof).await.unwrap();
        input.push(Input::Close).await.unwrap();
        input.finish();
        assert_eq!(input.recv().await, Some(data(SOFT_LIMIT)));
        assert_eq!(input.recv().await, Some(Input::Eof));
        assert_eq!(input.recv().await, Some(Input::Close));
        assert_eq!(input.recv().await, None);
        assert_eq!(input.push(data(1)).await, Err(PushError::Gone));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_output_lets_input_through_up_to_the_hard_limit() {
        let connection = Arc::new(ConnectionInput::default());
        let input = Arc::new(ChannelInput::new(connection.clone(), ChannelKind::Session));
        let other = ChannelInput::new(connection, ChannelKind::Session);
        input.push(data(SOFT_LIMIT)).await.unwrap();
        let pushing = tokio::spawn({
            let input = input.clone();
            async move { input.push(data(1000)).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!pushing.is_finished());
        // Another channel's output stalls: the waiting push goes through at once.
        let guard = other.stalled();
        pushing.await.unwrap().unwrap();
        let chunk = 1024 * 1024;
        let mut queued = SOFT_LIMIT + 1000;
        while queued + chunk <= HARD_LIMIT {
            input.push(data(chunk)).await.unwrap();
            queued += chunk;
        }
        assert_eq!(input.push(data(chunk)).await, Err(PushError::Overflow));
        assert_eq!(input.recv().await, Some(Input::Overflowed));
        assert_eq!(input.recv().await, None);
        assert_eq!(input.push(data(1)).await, Err(PushError::Gone));
        drop(guard);
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_consumer_releases_a_waiting_producer() {
        let input = Arc::new(ChannelInput::new(Arc::default(), ChannelKind::Session));
        input.push(data(SOFT_LIMIT)).await.unwrap();
        let pushing = tokio::spawn({
            let input = input.clone();
            async move { input.push(data(1)).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        input.close();
        assert_eq!(pushing.await.unwrap(), Err(PushError::Gone));
    }

    #[tokio::test(start_paused = true)]
    async fn the_connection_as_a_whole_is_bounded_too() {
        let connection = Arc::new(ConnectionInput::default());
        let channels: Vec<Arc<ChannelInput>> = (0..6)
            .map(|_| Arc::new(ChannelInput::new(connection.clone(), ChannelKind::Session)))
            .collect();
        for channel in &channels[..4] {
            channel.push(data(SOFT_LIMIT)).await.unwrap();
        }
        // Four full channels make a full connection: a fifth channel waits for its first byte.
        let pushing = tokio::spawn({
            let channel = channels[4].clone();
            async move { channel.push(data(10)).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!pushing.is_finished());
        assert_eq!(channels[0].recv().await, Some(data(SOFT_LIMIT)));
        pushing.await.unwrap().unwrap();

        // With output stalled, the connection takes up to its hard limit, then a channel that
        // would exceed it is closed.
        let _stalled = channels[5].stalled();
        let chunk = 1024 * 1024;
        let mut queued = 3 * SOFT_LIMIT + 10;
        let mut at = 1;
        loop {
            let channel = &channels[at];
            match channel.push(data(chunk)).await {
                Ok(()) => queued += chunk,
                Err(PushError::Overflow) => break,
                Err(PushError::Gone) => panic!("gone"),
            }
            assert!(queued <= CONNECTION_HARD_LIMIT);
            at = 1 + at % 4;
        }
        assert!(queued + chunk > CONNECTION_HARD_LIMIT, "{queued}");
    }

    #[test]
    fn signal_names() {
        assert_eq!(signal_name(&Sig::TERM), "TERM");
        assert_eq!(signal_name(&Sig::Custom("USR2".into())), "USR2");
    }
}
