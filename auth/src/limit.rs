//! Bounds on what one client may hold of a server: slots counted in total and per key (a
//! peer's address, a caller's identity), the connections that carry such a slot, and the
//! counters that say how often a bound was hit (each server exports them as one metric family,
//! labelled by limit).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::hash::Hash;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// How often each limit refused something, by limit name; shared by every limit of a process.
#[derive(Debug, Default)]
pub struct Bites(Mutex<BTreeMap<&'static str, u64>>);

impl Bites {
    /// A new, empty set of counters.
    pub fn new() -> Arc<Self> {
        Arc::new(Bites::default())
    }

    /// Make `limit` appear (at 0) before it ever bites.
    pub fn declare(&self, limit: &'static str) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(limit)
            .or_insert(0);
    }

    /// `limit` refused one thing.
    pub fn bite(&self, limit: &'static str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(limit)
            .or_insert(0) += 1;
    }

    /// Every limit and how often it refused, by name.
    pub fn counts(&self) -> Vec<(&'static str, u64)> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect()
    }

    /// How often `limit` refused.
    pub fn count(&self, limit: &str) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(limit)
            .copied()
            .unwrap_or(0)
    }
}

/// Which bound refused a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// Every slot is taken.
    Total,
    /// This key holds as many as one key may.
    PerKey,
}

/// What one key holds: how many slots, and (when the slots evict) each slot's [`Held`].
#[derive(Debug, Default)]
struct Holding {
    n: usize,
    held: HashMap<u64, Arc<Held>>,
}

#[derive(Debug)]
struct Counts<K> {
    total: usize,
    per_key: HashMap<K, Holding>,
    next_id: u64,
}

/// At most `total` slots at once, at most `per_key` of them for one key; each refusal counted
/// in [`Bites`] under the limit's names. The last tenth of the slots is kept for keys that hold
/// few (under a sixteenth of `per_key`). Slots made with [`Slots::evicting`] go further: when
/// they are full, a key holding fewer than the heaviest key (by two or more) takes the slot of
/// one of the heaviest key's idle connections ([`Held::busy`] marks the others), so no handful
/// of addresses can fill a listener against a newcomer; only as many addresses as slots can.
#[derive(Debug)]
pub struct Slots<K> {
    total_name: &'static str,
    per_key_name: &'static str,
    evicted_name: Option<&'static str>,
    max_total: usize,
    max_per_key: usize,
    counts: Mutex<Counts<K>>,
    bites: Arc<Bites>,
}

/// The state of one evictable slot, shared with the connection that holds it: whether a
/// request is in progress on it, and whether its slot was taken for a newcomer (the connection
/// then closes as soon as it is idle).
#[derive(Debug, Default)]
pub struct Held {
    busy: AtomicUsize,
    upgraded: std::sync::atomic::AtomicBool,
    evicted: CancellationToken,
}

/// A request in progress on a connection (its connection is not idle while this lives).
#[derive(Debug)]
pub struct Busy(Arc<Held>);

impl Held {
    /// Mark a request in progress until the guard is dropped.
    pub fn busy(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::AcqRel);
        Busy(self.clone())
    }

    /// The connection now carries another protocol (an HTTP upgrade, e.g. a websocket): it
    /// is busy until it closes.
    pub fn upgraded(&self) {
        self.upgraded.store(true, Ordering::Release);
    }

    fn idle(&self) -> bool {
        self.busy.load(Ordering::Acquire) == 0 && !self.upgraded.load(Ordering::Acquire)
    }

    /// Whether this slot was taken for a newcomer.
    pub fn is_evicted(&self) -> bool {
        self.evicted.is_cancelled()
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One slot of [`Slots`], given back when dropped.
#[derive(Debug)]
pub struct Slot<K: Hash + Eq> {
    owner: Arc<Slots<K>>,
    key: Option<K>,
    id: u64,
    held: Option<Arc<Held>>,
}

impl<K: Hash + Eq + Clone> Slots<K> {
    /// `max_total` slots, `max_per_key` per key (0 = no bound); refusals counted as
    /// `names.0` (total) and `names.1` (per key).
    pub fn new(
        names: (&'static str, &'static str),
        max_total: usize,
        max_per_key: usize,
        bites: Arc<Bites>,
    ) -> Arc<Self> {
        Self::build(names, None, max_total, max_per_key, bites)
    }

    /// Like [`Slots::new`], and when full a key holding few takes an idle slot of the key
    /// holding the most (each such eviction counted as `evicted`); every slot then carries a
    /// [`Held`] its holder must mark busy while a request is in progress, and close when
    /// evicted.
    pub fn evicting(
        names: (&'static str, &'static str),
        evicted: &'static str,
        max_total: usize,
        max_per_key: usize,
        bites: Arc<Bites>,
    ) -> Arc<Self> {
        Self::build(names, Some(evicted), max_total, max_per_key, bites)
    }

    fn build(
        names: (&'static str, &'static str),
        evicted_name: Option<&'static str>,
        max_total: usize,
        max_per_key: usize,
        bites: Arc<Bites>,
    ) -> Arc<Self> {
        // A bound that cannot bite gets no series.
        if max_total > 0 {
            bites.declare(names.0);
            if let Some(name) = evicted_name {
                bites.declare(name);
            }
        }
        if max_per_key > 0 {
            bites.declare(names.1);
        }
        Arc::new(Slots {
            total_name: names.0,
            per_key_name: names.1,
            evicted_name,
            max_total: if max_total == 0 {
                usize::MAX
            } else {
                max_total
            },
            max_per_key: if max_per_key == 0 {
                usize::MAX
            } else {
                max_per_key
            },
            counts: Mutex::new(Counts {
                total: 0,
                per_key: HashMap::new(),
                next_id: 0,
            }),
            bites,
        })
    }

    /// A slot for `key`, or which bound refused it (counted).
    pub fn try_acquire(self: &Arc<Self>, key: K) -> Result<Slot<K>, Full> {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let held = c.per_key.get(&key).map_or(0, |h| h.n);
        if held >= self.max_per_key {
            drop(c);
            self.bites.bite(self.per_key_name);
            return Err(Full::PerKey);
        }
        let reserved = self.max_total != usize::MAX
            && c.total >= self.max_total - self.max_total / 10
            && held >= (self.max_per_key / 16).max(1);
        if (c.total >= self.max_total || reserved) && !self.evict_for(&mut c, held) {
            drop(c);
            self.bites.bite(self.total_name);
            return Err(Full::Total);
        }
        let id = c.next_id;
        c.next_id += 1;
        let state = self.evicted_name.map(|_| Arc::new(Held::default()));
        let h = c.per_key.entry(key.clone()).or_default();
        h.n += 1;
        if let Some(s) = &state {
            h.held.insert(id, s.clone());
        }
        c.total += 1;
        Ok(Slot {
            owner: self.clone(),
            key: Some(key),
            id,
            held: state,
        })
    }

    /// Free a slot for a key holding `held`: an idle one of the heaviest key that holds at
    /// least two more (so that two keys never take turns evicting each other), marked
    /// evicted and no longer counted. False when these slots do not evict or none is idle.
    fn evict_for(&self, c: &mut Counts<K>, held: usize) -> bool {
        let Some(name) = self.evicted_name else {
            return false;
        };
        let mut heavy: Vec<(&K, usize)> = c
            .per_key
            .iter()
            .filter(|(_, h)| h.n >= held + 2)
            .map(|(k, h)| (k, h.n))
            .collect();
        heavy.sort_unstable_by_key(|h| std::cmp::Reverse(h.1));
        let victim = heavy.iter().find_map(|(k, _)| {
            let h = c.per_key.get(*k)?;
            let (id, _) = h.held.iter().find(|(_, s)| s.idle() && !s.is_evicted())?;
            Some(((*k).clone(), *id))
        });
        let Some((key, id)) = victim else {
            return false;
        };
        let Some(h) = c.per_key.get_mut(&key) else {
            return false;
        };
        if let Some(s) = h.held.remove(&id) {
            s.evicted.cancel();
        }
        h.n -= 1;
        if h.n == 0 {
            c.per_key.remove(&key);
        }
        c.total -= 1;
        self.bites.bite(name);
        true
    }

    /// Slots taken now.
    pub fn in_use(&self) -> usize {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).total
    }

    /// Slots taken now by `key`.
    pub fn in_use_by(&self, key: &K) -> usize {
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .per_key
            .get(key)
            .map_or(0, |h| h.n)
    }

    /// The bound on all slots together.
    pub fn max_total(&self) -> usize {
        self.max_total
    }
}

impl<K: Hash + Eq> Slot<K> {
    /// The slot's shared state, when its [`Slots`] evict.
    pub fn held(&self) -> Option<&Arc<Held>> {
        self.held.as_ref()
    }
}

impl<K: Hash + Eq> Drop for Slot<K> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
        let mut c = self.owner.counts.lock().unwrap_or_else(|p| p.into_inner());
        let Some(h) = c.per_key.get_mut(&key) else {
            return;
        };
        // An evicted slot was given back when it was taken for a newcomer.
        if self.held.is_some() && h.held.remove(&self.id).is_none() {
            return;
        }
        h.n -= 1;
        if h.n == 0 {
            c.per_key.remove(&key);
        }
        c.total = c.total.saturating_sub(1);
    }
}

/// Wait for a rate limiter's turn: `check` answers None when a turn is granted, else how long
/// until the next may be; after sleeping that long it is asked again, for at most `max_wait` in
/// all. Err(how far the next turn still was) when it would take longer.
pub async fn wait_turn(
    mut check: impl FnMut() -> Option<Duration>,
    max_wait: Duration,
) -> Result<(), Duration> {
    let mut waited = Duration::ZERO;
    while let Some(wait) = check() {
        if waited.saturating_add(wait) > max_wait {
            return Err(wait);
        }
        tokio::time::sleep(wait).await;
        waited += wait;
    }
    Ok(())
}

/// The key of a peer: its IP address (its ports are many).
pub fn peer_key(addr: &SocketAddr) -> IpAddr {
    match addr.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// A connection's brake: while it is held, nothing more is read from the connection. A server
/// holds it when it refuses a caller for being over a limit, so that the caller's next
/// requests wait in its own socket buffers instead of costing the server a refusal each: a
/// flood of refused calls is slowed to the pace of the brake, not answered at line rate.
/// What the server writes (answers, streams) still goes out.
#[derive(Debug, Default)]
pub struct Brake {
    until: Mutex<Option<Instant>>,
}

impl Brake {
    /// Read nothing more from the connection for `pause` from now (a brake already held
    /// longer stays as it is).
    pub fn hold(&self, pause: Duration) {
        let t = Instant::now() + pause;
        let mut until = self.until.lock().unwrap_or_else(|p| p.into_inner());
        if until.is_none_or(|u| u < t) {
            *until = Some(t);
        }
    }

    /// Until when the brake is held, if it is held now.
    pub fn held_until(&self) -> Option<Instant> {
        let until = *self.until.lock().unwrap_or_else(|p| p.into_inner());
        until.filter(|u| *u > Instant::now())
    }
}

/// What a server learns of a [`Conn`] with each request it carries: its addresses, and its
/// [`Brake`].
#[derive(Debug, Clone)]
pub struct ConnInfo {
    /// The connection's local and remote addresses.
    pub tcp: TcpConnectInfo,
    /// Holding it stops reading the connection for a while.
    pub brake: Arc<Brake>,
    /// The connection's slot state when its listener evicts idle connections: a server marks
    /// it [`Held::busy`] while it answers a request, so that only idle connections are closed.
    pub held: Option<Arc<Held>>,
}

/// An accepted TCP connection holding its slot of the listener's connection limit until it is
/// closed, read only while its [`Brake`] is released, and ending (as if the client closed it)
/// once its slot was evicted and no request is in progress. When the server closed it gracefully (an answer sent, e.g. 413 to a body too large)
/// while the client may still be sending, what the client sends is read and dropped for up to
/// `linger` before the socket is closed: closing with unread data would reset the connection,
/// and the client would see a broken connection instead of the answer.
#[derive(Debug)]
pub struct Conn {
    tcp: Option<TcpStream>,
    slot: Option<Slot<IpAddr>>,
    linger: Duration,
    shut_down: bool,
    brake: Arc<Brake>,
    paused: Option<Pin<Box<Sleep>>>,
    evicted: Option<(Arc<Held>, Pin<Box<WaitForCancellationFutureOwned>>)>,
}

impl Conn {
    /// `tcp`, holding `slot` while it is open, lingering `linger` after a graceful close.
    pub fn new(tcp: TcpStream, slot: Slot<IpAddr>, linger: Duration) -> Self {
        let evicted = slot
            .held()
            .map(|h| (h.clone(), Box::pin(h.evicted.clone().cancelled_owned())));
        Conn {
            tcp: Some(tcp),
            slot: Some(slot),
            linger,
            shut_down: false,
            brake: Arc::default(),
            paused: None,
            evicted,
        }
    }

    /// Whether the connection should end now: its slot was evicted and it is idle. Until
    /// then the eviction wakes the reader that waits on it.
    fn poll_evicted(&mut self, cx: &mut Context<'_>) -> bool {
        let Some((held, cancelled)) = &mut self.evicted else {
            return false;
        };
        (held.is_evicted() || cancelled.as_mut().poll(cx).is_ready()) && held.idle()
    }

    /// Pending until the brake is released, if it is held.
    fn poll_brake(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(until) = self.brake.held_until() else {
            self.paused = None;
            return Poll::Ready(());
        };
        let sleep = self
            .paused
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
        if sleep.deadline() != until {
            sleep.as_mut().reset(until);
        }
        // Ready once the deadline passes; a brake held again meanwhile is seen on the next read.
        sleep.as_mut().poll(cx)
    }

    fn tcp(&mut self) -> io::Result<&mut TcpStream> {
        self.tcp
            .as_mut()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))
    }

    /// The TCP stream.
    pub fn get_ref(&self) -> Option<&TcpStream> {
        self.tcp.as_ref()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.poll_brake(cx).is_pending() {
            return Poll::Pending;
        }
        if self.poll_evicted(cx) {
            // End of stream: the server closes the connection as if the client had.
            return Poll::Ready(Ok(()));
        }
        match self.tcp() {
            Ok(t) => Pin::new(t).poll_read(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.tcp() {
            Ok(t) => Pin::new(t).poll_write(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.tcp() {
            Ok(t) => Pin::new(t).poll_write_vectored(cx, bufs),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.tcp() {
            Ok(t) => Pin::new(t).poll_flush(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.shut_down = true;
        match self.tcp() {
            Ok(t) => Pin::new(t).poll_shutdown(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        ConnInfo {
            tcp: match &self.tcp {
                Some(t) => t.connect_info(),
                None => TcpConnectInfo {
                    local_addr: None,
                    remote_addr: None,
                },
            },
            brake: self.brake.clone(),
            held: self.evicted.as_ref().map(|(h, _)| h.clone()),
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let (Some(mut tcp), slot) = (self.tcp.take(), self.slot.take()) else {
            return;
        };
        if !self.shut_down || self.linger.is_zero() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let linger = self.linger;
        rt.spawn(async move {
            // The connection keeps its slot while it lingers.
            let _slot = slot;
            let mut sink = vec![0u8; 16 << 10];
            let _ = tokio::time::timeout(linger, async {
                while matches!(tcp.read(&mut sink).await, Ok(n) if n > 0) {}
            })
            .await;
        });
    }
}

/// Raise this process's soft limit on open files to its hard limit (the connection limits are
/// meant to bite before the process runs out of file descriptors); the soft limit after, None
/// when unlimited.
pub fn raise_open_files() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut l = getrlimit(Resource::Nofile);
    if l.current != l.maximum {
        l.current = l.maximum;
        if setrlimit(Resource::Nofile, l).is_err() {
            l = getrlimit(Resource::Nofile);
        }
    }
    l.current
}

/// `<prefix>_limited_total{listener,limit}`: what each listener's limits refused (connections,
/// bodies, client certificates naming another identity), one [`Bites`] per listener.
#[derive(Debug)]
pub struct Limited(pub Vec<(&'static str, Arc<Bites>)>);

impl prometheus_client::collector::Collector for Limited {
    fn encode(
        &self,
        mut enc: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        let mut m = enc.encode_descriptor(
            "limited",
            "Connections, request bodies or client certificates a listener's limits refused, by listener and limit",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (listener, bites) in &self.0 {
            for (limit, n) in bites.counts() {
                prometheus_client::metrics::counter::ConstCounter::new(n)
                    .encode(m.encode_family(&[("listener", *listener), ("limit", limit)])?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
