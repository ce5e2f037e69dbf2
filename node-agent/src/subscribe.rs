//! The node's ledger subscription: a view, then events, resumed from the last seq after any
//! disconnect, from whichever allocator replica answers, refusing epochs that go backwards.

use std::sync::Arc;
use std::time::Duration;

use gpuledger_auth::AuthChannel;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::allocator::v1::allocator_client::AllocatorClient;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::agent::Agent;

/// What to do with one subscription message, given the highest epoch seen so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Fold it in.
    Accept,
    /// From an older epoch than already seen: a deposed leader's or a stale replica's word.
    StaleEpoch,
}

/// Check a message's epoch against the highest seen (and raise it).
pub fn check_epoch(max_seen: &mut u64, epoch: u64) -> Verdict {
    if epoch < *max_seen {
        return Verdict::StaleEpoch;
    }
    *max_seen = epoch;
    Verdict::Accept
}

/// Follow the node's events forever.
pub async fn follow(agent: Arc<Agent>) {
    let mut max_epoch = 0u64;
    let mut i = 0usize;
    let node = agent.cfg.node_name.clone();
    loop {
        let (addr, mut c) = agent.pool.stream_at(i);
        let from_seq = agent.resume_seq();
        let span = info_span!("subscription", %node, replica = %addr, from_seq);
        subscribe_once(&agent, &mut c, &node, from_seq, &mut max_epoch)
            .instrument(span)
            .await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(
            if i.is_multiple_of(agent.pool.len()) {
                300
            } else {
                20
            },
        ))
        .await;
    }
}

/// One subscription at one replica, until it ends or breaks.
async fn subscribe_once(
    agent: &Agent,
    c: &mut AllocatorClient<AuthChannel>,
    node: &str,
    from_seq: u64,
    max_epoch: &mut u64,
) {
    match c
        .subscribe(api::SubscribeRequest {
            node: node.to_string(),
            from_seq,
        })
        .await
    {
        Ok(resp) => {
            info!("subscribed to the ledger");
            let mut s = resp.into_inner();
            loop {
                match s.message().await {
                    Ok(Some(m)) => {
                        if check_epoch(max_epoch, m.epoch) == Verdict::StaleEpoch {
                            warn!(
                                epoch = m.epoch,
                                max_epoch = *max_epoch,
                                "refusing a message from an older epoch; switching replica"
                            );
                            break;
                        }
                        agent.on_message(m).await;
                    }
                    Ok(None) => {
                        debug!("subscription ended");
                        break;
                    }
                    Err(e) => {
                        debug!("subscription broke: {e}");
                        break;
                    }
                }
            }
        }
        Err(e) => debug!("subscribe failed: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_epoch_lower_than_the_highest_seen_is_refused() {
        let mut m = 0;
        assert_eq!(check_epoch(&mut m, 5), Verdict::Accept);
        assert_eq!(check_epoch(&mut m, 5), Verdict::Accept);
        assert_eq!(check_epoch(&mut m, 4), Verdict::StaleEpoch);
        assert_eq!(m, 5);
        assert_eq!(check_epoch(&mut m, 9), Verdict::Accept);
        assert_eq!(m, 9);
    }
}
