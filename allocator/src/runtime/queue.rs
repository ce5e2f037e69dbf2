//! The controllers' work queue: bounded, each key at most once, and a key never in two workers' hands
//! at once (a key that changes while a worker has it is taken again once that worker is done),
//! as client-go's workqueue does.

use std::collections::{HashSet, VecDeque};
use std::hash::Hash;
use std::sync::Mutex;

use tokio::sync::Notify;

/// What [`Queue::push`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Queued (or queued to run again after the worker that has it).
    Queued,
    /// Already waiting: nothing to add.
    Already,
    /// The queue is full: dropped (the next full pass finds it).
    Full,
}

/// A bounded queue of keys.
pub struct Queue<K> {
    state: Mutex<State<K>>,
    ready: Notify,
    cap: usize,
}

struct State<K> {
    order: VecDeque<K>,
    /// Keys in `order`.
    queued: HashSet<K>,
    /// Keys a worker has.
    active: HashSet<K>,
    /// Active keys that changed meanwhile.
    again: HashSet<K>,
}

impl<K: Clone + Eq + Hash> Queue<K> {
    /// A queue holding at most `cap` keys waiting (at least 1).
    pub fn new(cap: usize) -> Self {
        Queue {
            state: Mutex::new(State {
                order: VecDeque::new(),
                queued: HashSet::new(),
                active: HashSet::new(),
                again: HashSet::new(),
            }),
            ready: Notify::new(),
            cap: cap.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<K>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keys waiting (the queue-depth metric).
    pub fn waiting(&self) -> usize {
        let s = self.lock();
        s.order.len() + s.again.len()
    }

    /// Add `k`.
    pub fn push(&self, k: K) -> Pushed {
        let mut s = self.lock();
        if s.queued.contains(&k) || s.again.contains(&k) {
            return Pushed::Already;
        }
        if s.order.len() + s.again.len() >= self.cap {
            return Pushed::Full;
        }
        if s.active.contains(&k) {
            s.again.insert(k);
        } else {
            s.queued.insert(k.clone());
            s.order.push_back(k);
            drop(s);
            self.ready.notify_one();
        }
        Pushed::Queued
    }

    fn try_pop(&self) -> Option<K> {
        let mut s = self.lock();
        let k = s.order.pop_front()?;
        s.queued.remove(&k);
        s.active.insert(k.clone());
        let more = !s.order.is_empty();
        drop(s);
        if more {
            self.ready.notify_one();
        }
        Some(k)
    }

    /// The next key; the caller has it until [`Queue::done`].
    pub async fn pop(&self) -> K {
        loop {
            if let Some(k) = self.try_pop() {
                return k;
            }
            self.ready.notified().await;
        }
    }

    /// The worker is done with `k`; a change that came meanwhile queues it again.
    pub fn done(&self, k: &K) {
        let mut s = self.lock();
        s.active.remove(k);
        if s.again.remove(k) {
            s.queued.insert(k.clone());
            s.order.push_back(k.clone());
            drop(s);
            self.ready.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bounded_deduplicated_and_one_worker_per_key() {
        let q = Queue::new(2);
        assert_eq!(q.push("a"), Pushed::Queued);
        assert_eq!(q.push("a"), Pushed::Already);
        assert_eq!(q.push("b"), Pushed::Queued);
        assert_eq!(q.push("c"), Pushed::Full);
        assert_eq!(q.waiting(), 2);
        let a = q.pop().await;
        assert_eq!(a, "a");
        // "a" changes while a worker has it: not handed out again until that worker is done.
        assert_eq!(q.push("a"), Pushed::Queued);
        assert_eq!(q.push("a"), Pushed::Already);
        assert_eq!(q.pop().await, "b");
        assert!(q.try_pop().is_none(), "a is still with its worker");
        q.done(&"a");
        assert_eq!(q.pop().await, "a");
        q.done(&"a");
        q.done(&"b");
        assert_eq!(q.waiting(), 0);
        assert!(q.try_pop().is_none());
    }

    #[tokio::test]
    async fn a_waiting_worker_wakes_on_push() {
        let q = std::sync::Arc::new(Queue::new(4));
        let q2 = q.clone();
        let w = tokio::spawn(async move { q2.pop().await });
        tokio::task::yield_now().await;
        q.push(7);
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), w)
            .await
            .expect("woken")
            .expect("joined");
        assert_eq!(got, 7);
    }
}
