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

#[test]
fn a_newcomer_takes_an_idle_slot_of_the_heaviest_key_when_full() {
    let bites = Bites::new();
    let s = Slots::evicting(("all", "one"), "evicted", 20, 16, bites.clone());
    let heavy: Vec<_> = (0..16).map(|_| s.try_acquire("heavy").unwrap()).collect();
    let light = [
        s.try_acquire("light").unwrap(),
        s.try_acquire("light").unwrap(),
    ];
    let _few = [
        s.try_acquire("few1").unwrap(),
        s.try_acquire("few2").unwrap(),
    ];
    assert_eq!(s.in_use(), 20);
    // Busy connections are never taken: all but one of the heavy key's are in a request.
    let busy: Vec<_> = heavy[1..]
        .iter()
        .chain(&light)
        .map(|h| h.held().unwrap().busy())
        .collect();
    let newcomer = s.try_acquire("new").unwrap();
    assert!(heavy[0].held().unwrap().is_evicted());
    assert!(heavy[1..].iter().all(|h| !h.held().unwrap().is_evicted()));
    assert_eq!((s.in_use(), s.in_use_by(&"heavy")), (20, 15));
    // No idle connection is left to take: refused.
    assert_eq!(s.try_acquire("other").unwrap_err(), Full::Total);
    drop(busy);
    // A key holding nearly as many as the heaviest takes nothing (no ping-pong).
    let s2 = Slots::evicting(("all", "one"), "evicted", 4, 4, Bites::new());
    let _a = [s2.try_acquire("a").unwrap(), s2.try_acquire("a").unwrap()];
    let _b = [s2.try_acquire("b").unwrap(), s2.try_acquire("b").unwrap()];
    assert_eq!(s2.try_acquire("b").unwrap_err(), Full::Total);
    assert!(s2.try_acquire("c").is_ok(), "a key holding none does");
    // An upgraded connection (a websocket) is never idle.
    let s3 = Slots::evicting(("all", "one"), "evicted", 3, 3, Bites::new());
    let up: Vec<_> = (0..3).map(|_| s3.try_acquire("ws").unwrap()).collect();
    up.iter().for_each(|u| u.held().unwrap().upgraded());
    assert_eq!(s3.try_acquire("new").unwrap_err(), Full::Total);
    // The evicted slot is given back once only.
    drop(heavy);
    drop(newcomer);
    assert_eq!((s.in_use(), s.in_use_by(&"heavy")), (4, 0));
    assert_eq!(bites.count("evicted"), 1);
    assert_eq!(bites.count("all"), 1);
}

/// Regression (hostile load II): 4 addresses at the per-peer limit and 8 at a fifteenth of it
/// held all 1,024 slots (the last tenth being kept only for keys under a sixteenth), and a
/// newcomer was refused. Whatever a dozen keys hold, a key holding nothing gets in.
#[test]
fn a_dozen_keys_cannot_fill_the_slots_against_a_newcomer() {
    let s = Slots::evicting(("all", "one"), "evicted", 1024, 256, Bites::new());
    let mut held = Vec::new();
    for key in 0..12u32 {
        while let Ok(slot) = s.try_acquire(key) {
            held.push(slot);
            if held.len() > 4096 {
                break;
            }
        }
    }
    assert_eq!(s.in_use(), 1024, "the attackers filled the slots");
    for newcomer in 100..110u32 {
        assert!(
            s.try_acquire(newcomer).is_ok(),
            "newcomer {newcomer} refused"
        );
    }
}

#[tokio::test]
async fn an_evicted_connection_ends_once_idle() {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let slots = Slots::evicting(("t", "k"), "e", 3, 3, Bites::new());
    let mut conns = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(TcpStream::connect(addr).await.unwrap());
        let (tcp, _) = listener.accept().await.unwrap();
        let slot = slots.try_acquire(IpAddr::from([10, 0, 0, 1])).unwrap();
        conns.push(Conn::new(tcp, slot, Duration::ZERO));
    }
    let mut victim = conns.remove(0);
    let _others: Vec<_> = conns
        .iter()
        .map(|c| c.slot.as_ref().unwrap().held().unwrap().busy())
        .collect();
    let _new = slots.try_acquire(IpAddr::from([10, 0, 0, 2])).unwrap();
    // A request that began as it was evicted is still read.
    let busy = victim.slot.as_ref().unwrap().held().unwrap().busy();
    clients[0].write_all(b"x").await.unwrap();
    let mut buf = [0u8; 4];
    assert_eq!(victim.read(&mut buf).await.unwrap(), 1);
    drop(busy);
    // Idle: the next read ends the stream (the server closes the connection).
    let n = tokio::time::timeout(Duration::from_secs(1), victim.read(&mut buf)).await;
    assert_eq!(n.unwrap().unwrap(), 0);
}
