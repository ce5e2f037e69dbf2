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
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
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

#[derive(Debug)]
struct Counts<K> {
    total: usize,
    per_key: HashMap<K, usize>,
}

/// At most `total` slots at once, at most `per_key` of them for one key; each refusal counted
/// in [`Bites`] under the limit's names. The last tenth of the slots is kept for keys that hold
/// few (under a sixteenth of `per_key`): attackers behind a handful of addresses can fill nine
/// tenths of a listener, never the room an honest client with a connection or two needs.
#[derive(Debug)]
pub struct Slots<K> {
    total_name: &'static str,
    per_key_name: &'static str,
    max_total: usize,
    max_per_key: usize,
    counts: Mutex<Counts<K>>,
    bites: Arc<Bites>,
}

/// One slot of [`Slots`], given back when dropped.
#[derive(Debug)]
pub struct Slot<K: Hash + Eq> {
    owner: Arc<Slots<K>>,
    key: Option<K>,
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
        // A bound that cannot bite gets no series.
        if max_total > 0 {
            bites.declare(names.0);
        }
        if max_per_key > 0 {
            bites.declare(names.1);
        }
        Arc::new(Slots {
            total_name: names.0,
            per_key_name: names.1,
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
            }),
            bites,
        })
    }

    /// A slot for `key`, or which bound refused it (counted).
    pub fn try_acquire(self: &Arc<Self>, key: K) -> Result<Slot<K>, Full> {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let held = c.per_key.get(&key).copied().unwrap_or(0);
        let reserved = self.max_total != usize::MAX
            && c.total >= self.max_total - self.max_total / 10
            && held >= (self.max_per_key / 16).max(1);
        if c.total >= self.max_total || reserved {
            drop(c);
            self.bites.bite(self.total_name);
            return Err(Full::Total);
        }
        let n = c.per_key.entry(key.clone()).or_insert(0);
        if *n >= self.max_per_key {
            drop(c);
            self.bites.bite(self.per_key_name);
            return Err(Full::PerKey);
        }
        *n += 1;
        c.total += 1;
        Ok(Slot {
            owner: self.clone(),
            key: Some(key),
        })
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
            .copied()
            .unwrap_or(0)
    }

    /// The bound on all slots together.
    pub fn max_total(&self) -> usize {
        self.max_total
    }
}

impl<K: Hash + Eq> Drop for Slot<K> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
        let mut c = self.owner.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.per_key.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                c.per_key.remove(&key);
            }
        }
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
}

/// An accepted TCP connection holding its slot of the listener's connection limit until it is
/// closed, and read only while its [`Brake`] is released. When the server closed it gracefully (an answer sent, e.g. 413 to a body too large)
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
}

impl Conn {
    /// `tcp`, holding `slot` while it is open, lingering `linger` after a graceful close.
    pub fn new(tcp: TcpStream, slot: Slot<IpAddr>, linger: Duration) -> Self {
        Conn {
            tcp: Some(tcp),
            slot: Some(slot),
            linger,
            shut_down: false,
            brake: Arc::default(),
            paused: None,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_bound_the_total_and_each_key_and_count_refusals() {
        let bites = Bites::new();
        let s = Slots::new(("all", "one"), 3, 2, bites.clone());
        let a1 = s.try_acquire("a").unwrap();
        let _a2 = s.try_acquire("a").unwrap();
        assert_eq!(s.try_acquire("a").unwrap_err(), Full::PerKey);
        let _b1 = s.try_acquire("b").unwrap();
        assert_eq!(s.try_acquire("c").unwrap_err(), Full::Total);
        assert_eq!(s.in_use(), 3);
        drop(a1);
        assert_eq!(s.in_use_by(&"a"), 1);
        let _c1 = s.try_acquire("c").unwrap();
        assert_eq!(bites.counts(), vec![("all", 1), ("one", 1)]);
    }

    #[test]
    fn the_last_tenth_is_kept_for_keys_that_hold_few() {
        let s = Slots::new(("all", "one"), 100, 64, Bites::new());
        // Two greedy keys take nine tenths.
        let mut held = Vec::new();
        for i in 0..90 {
            held.push(s.try_acquire(i % 2).unwrap());
        }
        assert_eq!(s.try_acquire(0).unwrap_err(), Full::Total);
        // A key with a few slots still gets in, up to 64 / 16 = 4.
        for _ in 0..4 {
            held.push(s.try_acquire(7).unwrap());
        }
        assert_eq!(s.try_acquire(7).unwrap_err(), Full::Total);
        assert!(s.try_acquire(8).is_ok());
    }

    #[test]
    fn a_key_without_slots_is_forgotten() {
        let s = Slots::new(("t", "k"), 0, 1, Bites::new());
        for i in 0..1000 {
            drop(s.try_acquire(i).unwrap());
        }
        assert_eq!(s.counts.lock().unwrap().per_key.len(), 0);
    }

    #[tokio::test]
    async fn a_held_brake_stops_reading_until_it_is_released() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (tcp, peer) = listener.accept().await.unwrap();
        let slots = Slots::new(("t", "k"), 0, 0, Bites::new());
        let mut conn = Conn::new(
            tcp,
            slots.try_acquire(peer_key(&peer)).unwrap(),
            Duration::ZERO,
        );
        let brake = conn.connect_info().brake;
        client.write_all(b"one").await.unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(conn.read(&mut buf).await.unwrap(), 3);

        brake.hold(Duration::from_millis(300));
        brake.hold(Duration::from_millis(10)); // a shorter hold does not shorten it
        client.write_all(b"two").await.unwrap();
        let t = std::time::Instant::now();
        assert_eq!(conn.read(&mut buf).await.unwrap(), 3);
        assert!(
            t.elapsed() >= Duration::from_millis(280),
            "{:?}",
            t.elapsed()
        );
        assert!(brake.held_until().is_none());
        // Released, reads are immediate again.
        client.write_all(b"three").await.unwrap();
        let t = std::time::Instant::now();
        assert_eq!(conn.read(&mut buf).await.unwrap(), 5);
        assert!(t.elapsed() < Duration::from_millis(200));
    }

    #[test]
    fn ipv4_mapped_peers_are_one_key() {
        let v4: SocketAddr = "10.0.0.1:5".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:6".parse().unwrap();
        assert_eq!(peer_key(&v4), peer_key(&mapped));
    }
}
