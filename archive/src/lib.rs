//! The append-only audit archive of the ledger: batches moved out of etcd so that etcd's size
//! stays bounded under constant churn, while audit and replay still read the whole history.
//!
//! The archive is a directory (in Kubernetes a volume every allocator replica mounts) of
//! segment files `batches-<first seq>-<last seq>.pb`, each holding length-delimited
//! `EventBatch` messages, gapless from seq 1. A segment is written to a temporary file,
//! fsynced and renamed into place, so a reader never sees half a segment and two leaders
//! archiving the same range (a paused one and its successor) write the same file twice,
//! harmlessly. The allocator leader fills it and trims etcd behind it; the allocator's
//! `ReadLog` and the chaos checker read archive and etcd as one.
//!
//! A segment keeps each batch's exact bytes as etcd stored them, so the hash chain over the
//! log (`gpuledger_ledger::chain`) runs on through the archive; a batch read back carries
//! the hash of its record and the segment it came from in `EventBatch.stored`.

use std::path::{Path, PathBuf};

use gpuledger_ledger::chain::hash_stored;
use gpuledger_proto::ledger::v1 as pb;
use prost::Message;

/// Errors of the archive.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// The directory or a file in it could not be read or written; retrying may work (a
    /// volume that was not mounted yet, a full disk).
    #[error("archive {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A segment does not decode or does not hold what its name says. Not retryable: an
    /// operator must look.
    #[error("archive segment {path} is corrupt: {why}")]
    Corrupt {
        /// The segment.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// Batches to archive do not follow the archive's last seq: history would have a hole.
    /// Not retryable: etcd no longer holds what the archive lacks.
    #[error("archive ends at seq {archived} but the next batch starts at seq {next}")]
    Gap {
        /// Last seq in the archive.
        archived: u64,
        /// First seq offered.
        next: u64,
    },
}

/// One segment: the seqs it holds and its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// First seq in the segment.
    pub first: u64,
    /// Last seq in the segment.
    pub last: u64,
    /// The file.
    pub path: PathBuf,
}

/// Handle on an archive directory.
#[derive(Debug, Clone)]
pub struct Archive {
    dir: PathBuf,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ArchiveError + '_ {
    move |source| ArchiveError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The last seq of a batch (its first seq − 1 when empty).
pub fn last_seq(b: &pb::EventBatch) -> u64 {
    b.events
        .last()
        .map_or(b.first_seq.saturating_sub(1), |e| e.seq)
}

impl Archive {
    /// The archive in `dir` (created when missing).
    pub fn open(dir: &Path) -> Result<Archive, ArchiveError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        Ok(Archive {
            dir: dir.to_path_buf(),
        })
    }

    /// The archive's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Run `f` on this archive on tokio's blocking pool: its reads, writes and fsyncs must not
    /// hold up an async worker (the leader's sequencer shares them).
    pub async fn off_thread<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Archive) -> Result<T, ArchiveError> + Send + 'static,
    ) -> Result<T, ArchiveError> {
        let a = self.clone();
        tokio::task::spawn_blocking(move || f(&a))
            .await
            .map_err(|e| ArchiveError::Io {
                path: self.dir.clone(),
                source: std::io::Error::other(format!("the archive task failed: {e}")),
            })?
    }

    /// Segments in seq order, checked to follow each other without a gap from seq 1.
    pub fn segments(&self) -> Result<Vec<Segment>, ArchiveError> {
        let mut segs = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(io(&self.dir))? {
            let entry = entry.map_err(io(&self.dir))?;
            let name = entry.file_name();
            let Some(range) = name
                .to_str()
                .and_then(|n| n.strip_prefix("batches-"))
                .and_then(|n| n.strip_suffix(".pb"))
            else {
                continue;
            };
            let parsed = range
                .split_once('-')
                .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
            let Some((first, last)) = parsed else {
                return Err(ArchiveError::Corrupt {
                    path: entry.path(),
                    why: "the name is not batches-<first>-<last>.pb".into(),
                });
            };
            segs.push(Segment {
                first,
                last,
                path: entry.path(),
            });
        }
        segs.sort_by_key(|s| s.first);
        let mut next = 1;
        for s in &segs {
            if s.first != next || s.last < s.first {
                return Err(ArchiveError::Corrupt {
                    path: s.path.clone(),
                    why: format!("expected a segment starting at seq {next}"),
                });
            }
            next = s.last + 1;
        }
        Ok(segs)
    }

    /// The last archived seq (0 = nothing archived).
    pub fn last_seq(&self) -> Result<u64, ArchiveError> {
        Ok(self.segments()?.last().map_or(0, |s| s.last))
    }

    /// Append whole batches, each as the exact bytes etcd stored (with the batch they decode
    /// to), as one segment. Batches already archived are skipped (another leader got there
    /// first); the rest must follow the archive without a gap. Durable when this returns.
    pub fn append(&self, batches: &[(pb::EventBatch, Vec<u8>)]) -> Result<u64, ArchiveError> {
        let archived = self.last_seq()?;
        let fresh: Vec<&(pb::EventBatch, Vec<u8>)> = batches
            .iter()
            .filter(|(b, _)| last_seq(b) > archived)
            .collect();
        let (Some(first), Some(last)) = (fresh.first(), fresh.last()) else {
            return Ok(archived);
        };
        let mut expect = archived + 1;
        for (b, _) in &fresh {
            if b.first_seq != expect {
                return Err(ArchiveError::Gap {
                    archived: expect - 1,
                    next: b.first_seq,
                });
            }
            expect = last_seq(b) + 1;
        }
        let (first, last) = (first.0.first_seq, last_seq(&last.0));
        let mut bytes = Vec::new();
        for (_, stored) in &fresh {
            prost::encoding::encode_varint(stored.len() as u64, &mut bytes);
            bytes.extend_from_slice(stored);
        }
        let path = self.dir.join(format!("batches-{first:020}-{last:020}.pb"));
        let tmp = self.dir.join(format!(
            ".batches-{first:020}-{last:020}.{}.tmp",
            std::process::id()
        ));
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
            f.write_all(&bytes).map_err(io(&tmp))?;
            f.sync_all().map_err(io(&tmp))?;
        }
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&self.dir))?;
        Ok(last)
    }

    /// Hand the archived batches holding seqs `from..=to` (`to` = 0: to the end) to `f`, in
    /// order, until it returns false, each with `stored` set (its record's hash, its segment).
    /// Returns the last seq handed over (0 = none).
    pub fn read(
        &self,
        from: u64,
        to: u64,
        mut f: impl FnMut(pb::EventBatch) -> bool,
    ) -> Result<u64, ArchiveError> {
        let mut handed = 0;
        for b in self.batches(from, to)? {
            let b = b?;
            handed = last_seq(&b);
            if !f(b) {
                break;
            }
        }
        Ok(handed)
    }

    /// The archived batches holding seqs `from..=to` (`to` = 0: to the end), in order, as
    /// [`Archive::read`] hands them over; a caller can take some, put the rest aside (another
    /// thread, later) and go on where it stopped, without reading the archive again.
    pub fn batches(&self, from: u64, to: u64) -> Result<Batches, ArchiveError> {
        Ok(Batches {
            from,
            to,
            segments: self.segments()?.into_iter(),
            open: None,
            done: false,
        })
    }
}

/// The batches of an archive from a seq on ([`Archive::batches`]), read a segment at a time;
/// after an error, nothing more.
#[derive(Debug)]
pub struct Batches {
    from: u64,
    to: u64,
    segments: std::vec::IntoIter<Segment>,
    open: Option<OpenSegment>,
    done: bool,
}

/// The segment [`Batches`] reads: its bytes, where its next record starts, and the seq that
/// record must start at.
#[derive(Debug)]
struct OpenSegment {
    segment: Segment,
    bytes: Vec<u8>,
    at: usize,
    expect: u64,
    location: String,
}

impl Batches {
    fn advance(&mut self) -> Result<Option<pb::EventBatch>, ArchiveError> {
        loop {
            let Some(open) = &mut self.open else {
                let Some(s) = self.segments.next() else {
                    return Ok(None);
                };
                if s.last < self.from {
                    continue;
                }
                if self.to > 0 && s.first > self.to {
                    return Ok(None);
                }
                let bytes = std::fs::read(&s.path).map_err(io(&s.path))?;
                self.open = Some(OpenSegment {
                    location: format!("archive {}", s.path.display()),
                    expect: s.first,
                    bytes,
                    at: 0,
                    segment: s,
                });
                continue;
            };
            let corrupt = |why: String| ArchiveError::Corrupt {
                path: open.segment.path.clone(),
                why,
            };
            if open.at >= open.bytes.len() {
                if open.expect != open.segment.last + 1 {
                    return Err(corrupt(format!(
                        "ends at seq {} but its name says {}",
                        open.expect - 1,
                        open.segment.last
                    )));
                }
                self.open = None;
                continue;
            }
            let mut buf = &open.bytes[open.at..];
            let len =
                prost::encoding::decode_varint(&mut buf).map_err(|e| corrupt(e.to_string()))?;
            let len = usize::try_from(len)
                .ok()
                .filter(|&l| l <= buf.len())
                .ok_or_else(|| corrupt(format!("a record of {len} bytes runs past the end")))?;
            let record = &buf[..len];
            open.at = open.bytes.len() - buf.len() + len;
            let mut b = pb::EventBatch::decode(record).map_err(|e| corrupt(e.to_string()))?;
            b.stored = Some(pb::StoredAt {
                hash: hash_stored(record).to_vec(),
                location: open.location.clone(),
            });
            if b.first_seq != open.expect {
                return Err(corrupt(format!(
                    "batch at seq {} where {} was due",
                    b.first_seq, open.expect
                )));
            }
            let last = last_seq(&b);
            open.expect = last + 1;
            if last < self.from {
                continue;
            }
            if self.to > 0 && b.first_seq > self.to {
                return Ok(None);
            }
            return Ok(Some(b));
        }
    }
}

impl Iterator for Batches {
    type Item = Result<pb::EventBatch, ArchiveError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let next = self.advance().transpose();
        self.done = !matches!(next, Some(Ok(_)));
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(first: u64, n: u64) -> (pb::EventBatch, Vec<u8>) {
        let b = pb::EventBatch {
            version: 1,
            first_seq: first,
            epoch: 7,
            events: (first..first + n)
                .map(|seq| pb::Event {
                    seq,
                    epoch: 7,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let bytes = b.encode_to_vec();
        (b, bytes)
    }

    fn seqs(a: &Archive, from: u64, to: u64) -> Vec<u64> {
        let mut out = Vec::new();
        a.read(from, to, |b| {
            out.extend(b.events.iter().map(|e| e.seq));
            true
        })
        .expect("read");
        out
    }

    #[test]
    fn appends_gaplessly_and_reads_ranges_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Archive::open(dir.path()).expect("open");
        assert_eq!(a.last_seq().expect("last"), 0);
        assert_eq!(a.append(&[batch(1, 3), batch(4, 2)]).expect("append"), 5);
        assert_eq!(a.append(&[batch(6, 4)]).expect("append"), 9);
        assert_eq!(seqs(&a, 1, 0), (1..=9).collect::<Vec<_>>());
        // The batch holding `from` comes whole; `to` stops after the batch holding it.
        assert_eq!(seqs(&a, 5, 6), vec![4, 5, 6, 7, 8, 9]);
        assert_eq!(a.segments().expect("segments").len(), 2);
    }

    #[test]
    fn a_batch_read_back_names_the_hash_of_its_exact_bytes_and_its_segment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Archive::open(dir.path()).expect("open");
        let (b1, bytes1) = batch(1, 2);
        a.append(&[(b1, bytes1.clone()), batch(3, 1)])
            .expect("append");
        let mut read = Vec::new();
        a.read(1, 0, |b| {
            read.push(b.stored.expect("stamped"));
            true
        })
        .expect("read");
        assert_eq!(read.len(), 2);
        assert_eq!(read[0].hash, hash_stored(&bytes1).to_vec());
        assert!(
            read[0]
                .location
                .contains("batches-00000000000000000001-00000000000000000003.pb"),
            "{}",
            read[0].location
        );
    }

    #[test]
    fn batches_taken_a_few_at_a_time_go_on_where_they_stopped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Archive::open(dir.path()).expect("open");
        a.append(&[batch(1, 3), batch(4, 2), batch(6, 1)])
            .expect("append");
        a.append(&[batch(7, 2), batch(9, 1)]).expect("append");
        let mut it = a.batches(5, 0).expect("batches");
        let page: Vec<u64> = it
            .by_ref()
            .take(2)
            .map(|b| b.expect("b").first_seq)
            .collect();
        assert_eq!(page, vec![4, 6], "from the batch holding seq 5");
        // Put aside (another thread), then the rest, across the segment boundary.
        let rest =
            std::thread::spawn(move || it.map(|b| b.expect("b").first_seq).collect::<Vec<u64>>())
                .join()
                .expect("thread");
        assert_eq!(rest, vec![7, 9]);
        let upto: Vec<u64> = a
            .batches(2, 7)
            .expect("batches")
            .map(|b| b.expect("b").first_seq)
            .collect();
        assert_eq!(upto, vec![1, 4, 6, 7]);
    }

    #[test]
    fn appending_what_is_archived_again_is_harmless() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Archive::open(dir.path()).expect("open");
        a.append(&[batch(1, 3), batch(4, 2)]).expect("append");
        // A second leader archiving the same range, then a little more.
        assert_eq!(a.append(&[batch(1, 3), batch(4, 2)]).expect("again"), 5);
        assert_eq!(a.append(&[batch(4, 2), batch(6, 1)]).expect("more"), 6);
        assert_eq!(seqs(&a, 1, 0), (1..=6).collect::<Vec<_>>());
    }

    #[test]
    fn refuses_a_hole_in_history() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Archive::open(dir.path()).expect("open");
        a.append(&[batch(1, 3)]).expect("append");
        assert!(matches!(
            a.append(&[batch(5, 1)]),
            Err(ArchiveError::Gap {
                archived: 3,
                next: 5
            })
        ));
        assert!(matches!(
            a.append(&[batch(4, 1), batch(6, 1)]),
            Err(ArchiveError::Gap {
                archived: 4,
                next: 6
            })
        ));
        assert_eq!(
            a.last_seq().expect("last"),
            3,
            "nothing of a refused append is written"
        );
    }

    #[test]
    fn a_damaged_segment_is_reported_not_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Archive::open(dir.path()).expect("open");
        a.append(&[batch(1, 3)]).expect("append");
        a.append(&[batch(4, 3)]).expect("append");
        let segs = a.segments().expect("segments");
        let bytes = std::fs::read(&segs[1].path).expect("read");
        std::fs::write(&segs[1].path, &bytes[..bytes.len() - 2]).expect("truncate");
        let err = a.read(1, 0, |_| true).expect_err("a truncated segment");
        assert!(matches!(err, ArchiveError::Corrupt { .. }), "{err}");
        std::fs::remove_file(&segs[0].path).expect("remove");
        let err = a.segments().expect_err("a missing first segment");
        assert!(err.to_string().contains("starting at seq 1"), "{err}");
    }
}
