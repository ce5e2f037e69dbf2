//! Command-line flags (also read from `GPULEDGER_*` environment variables).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

/// gpuledger-allocator: the leader-elected GPU ledger on etcd.
///
/// Run 2-3 replicas against the same etcd and --cluster. One is elected leader through an etcd
/// lease and writes the ledger; the others follow the log, serve reads and forward writes to the
/// leader, so clients may talk to any replica. If etcd is unreachable or this replica holds no
/// lease it grants nothing and says why.
#[derive(Parser, Debug, Clone)]
#[command(name = "gpuledger-allocator", version, about, long_about)]
pub struct Config {
    /// etcd client endpoints, comma-separated.
    #[arg(
        long,
        env = "GPULEDGER_ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379"
    )]
    pub etcd_endpoints: Vec<String>,

    /// PEM CA bundle that signed etcd's server certificate; turns on TLS to etcd (use https://
    /// endpoints).
    #[arg(long, env = "GPULEDGER_ETCD_CA")]
    pub etcd_ca: Option<std::path::PathBuf>,

    /// PEM client certificate for etcd's --client-cert-auth (with --etcd-key).
    #[arg(long, env = "GPULEDGER_ETCD_CERT", requires = "etcd_key")]
    pub etcd_cert: Option<std::path::PathBuf>,

    /// PEM private key of --etcd-cert.
    #[arg(long, env = "GPULEDGER_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<std::path::PathBuf>,

    /// Ledger name: keys live under /gpuledger/<cluster>/ in etcd.
    #[arg(long, env = "GPULEDGER_CLUSTER", default_value = "default")]
    pub cluster: String,

    /// Address the gRPC API listens on.
    #[arg(long, env = "GPULEDGER_LISTEN", default_value = "0.0.0.0:7420")]
    pub listen: SocketAddr,

    /// Address of the HTTP endpoints /metrics, /healthz and /readyz.
    #[arg(long, env = "GPULEDGER_HTTP_LISTEN", default_value = "0.0.0.0:7421")]
    pub http_listen: SocketAddr,

    /// The bounds of --http-listen's port.
    #[command(flatten)]
    pub http: gpuledger_auth::PlainHttpArgs,

    /// Address other replicas use to reach this one (host:port). Default: --listen, with
    /// 0.0.0.0 replaced by 127.0.0.1 (set it to the pod IP in Kubernetes).
    #[arg(long, env = "GPULEDGER_ADVERTISE")]
    pub advertise: Option<String>,

    /// This replica's name in the ledger and logs. Default: the host name and port.
    #[arg(long, env = "GPULEDGER_REPLICA")]
    pub replica: Option<String>,

    /// Leader lease TTL in seconds (etcd's minimum is 1.5 x its election timeout). A crashed
    /// leader is replaced after about this long.
    #[arg(long, env = "GPULEDGER_LEASE_TTL", default_value_t = 2)]
    pub lease_ttl: u64,

    /// Most events in one ledger batch (one etcd transaction); etcd's --max-txn-ops default.
    #[arg(long, env = "GPULEDGER_MAX_TXN_OPS", default_value_t = 128)]
    pub max_txn_ops: usize,

    /// Most bytes in one ledger batch (etcd refuses requests over 1.5 MiB by default).
    #[arg(long, env = "GPULEDGER_MAX_BATCH_BYTES", default_value_t = 1024 * 1024)]
    pub max_batch_bytes: usize,

    /// How long a bind confirmation may wait for other writes to share its etcd transaction,
    /// in milliseconds (0 = write at once). Nothing waits on confirmations: the extender
    /// sends them after the scheduler has its answer, and the pod watch would record the
    /// binding anyway. Sharing transactions saves etcd CPU when many pods bind.
    #[arg(long, env = "GPULEDGER_CONFIRM_LINGER_MS", default_value_t = 5)]
    pub confirm_linger_ms: u64,

    /// Under load, how long after a commit the next ledger batch may wait for more requests
    /// to share its etcd transaction, in microseconds (0 = never). Only once the last
    /// transaction answered 8 or more requests: a lone client is never delayed. etcd spends
    /// about the same CPU on a transaction of 1 event as of 60, so on a busy machine fuller
    /// batches raise throughput.
    #[arg(long, env = "GPULEDGER_COMMIT_LINGER_US", default_value_t = 0)]
    pub commit_linger_us: u64,

    /// The audit archive: a directory every replica mounts (a shared volume), where the leader
    /// moves old ledger batches before deleting them from etcd, so etcd's size stays bounded;
    /// `audit`, `replay`, `usage` and `verify` read archive and etcd as one. Without it the
    /// whole log stays in etcd and grows with every event.
    #[arg(long, env = "GPULEDGER_ARCHIVE_DIR")]
    pub archive_dir: Option<std::path::PathBuf>,

    /// Events kept in etcd behind the head when archiving (for replicas that lag). Only
    /// batches older than the newest snapshot are ever archived.
    #[arg(long, env = "GPULEDGER_LOG_RETAIN_EVENTS", default_value_t = 100_000)]
    pub log_retain_events: u64,

    /// How often the leader moves old batches to the archive, in milliseconds.
    #[arg(long, env = "GPULEDGER_ARCHIVE_INTERVAL_MS", default_value_t = 30_000)]
    pub archive_interval_ms: u64,

    /// Write a snapshot of the folded state every this many events (0 = never).
    #[arg(long, env = "GPULEDGER_SNAPSHOT_EVERY", default_value_t = 10_000)]
    pub snapshot_every: u64,

    /// Load the state from the whole log at start, ignoring snapshots (slower; for when a
    /// snapshot is suspect).
    #[arg(long, env = "GPULEDGER_IGNORE_SNAPSHOTS")]
    pub ignore_snapshots: bool,

    /// How long a reservation may stay unbound before it expires, in seconds.
    #[arg(long, env = "GPULEDGER_RESERVE_TTL", default_value_t = 60)]
    pub reserve_ttl: u64,

    /// Timeout of one etcd request, in milliseconds.
    #[arg(long, env = "GPULEDGER_ETCD_TIMEOUT_MS", default_value_t = 2000)]
    pub etcd_timeout_ms: u64,

    /// Kubernetes watchers (pod/node lifecycle, reservation expiry).
    #[command(flatten)]
    pub kube: crate::kube_watch::KubeArgs,

    /// gpuledger's own preemption of GPU slices (the extender's `Preempt`).
    #[command(flatten)]
    pub preempt: crate::preemption::PreemptArgs,

    /// Placement policy of pods that name none (annotation `gpuledger.io/policy`): binpack,
    /// spread, fgd, fgd-pack, fgd-pack-cpu, fgd-strand, random, dotprod, bestfit, packing or
    /// clustering.
    #[arg(long, env = "GPULEDGER_DEFAULT_POLICY", default_value = "binpack", value_parser = parse_policy)]
    pub default_policy: gpuledger_ledger::Policy,

    /// FGD learns the cluster's pod shapes from this many most recent reservations.
    #[arg(long, env = "GPULEDGER_FGD_WINDOW", default_value_t = 1000)]
    pub fgd_window: usize,

    /// Until this many reservations are in the window, FGD uses a neutral prior (whole GPUs,
    /// halves, quarters, tenths, multi-GPU pods).
    #[arg(long, env = "GPULEDGER_FGD_MIN_SAMPLES", default_value_t = 100)]
    pub fgd_min_samples: usize,

    /// The gRPC API's TLS: this replica's certificate, and the CA of client certificates.
    #[command(flatten)]
    pub tls: gpuledger_auth::ServerTlsArgs,

    /// How this replica calls the others (writes forwarded to the leader): the CA of their
    /// certificates and its own identity (a token of the allocator's ServiceAccount or an
    /// allocator client certificate).
    #[command(flatten)]
    pub peer: gpuledger_auth::CredentialArgs,

    /// Serve the live GPU map (`/ui`) and its JSON (`/api/v1/state`, `/api/v1/events`) on
    /// --http-listen. Off by default: they name every tenant's pods and that port has no
    /// authentication; turn it on where only operators reach the port (`kubectl port-forward`
    /// with a NetworkPolicy that admits nobody else).
    #[arg(long, env = "GPULEDGER_HTTP_STATE_API")]
    pub http_state_api: bool,

    /// The namespace of gpuledger's ServiceAccounts: a token's role is its account's name there.
    #[arg(
        long,
        env = "GPULEDGER_AUTH_NAMESPACE",
        default_value = "gpuledger-system"
    )]
    pub auth_namespace: String,

    /// The scheduler names whose pods the extender may reserve GPUs for (comma-separated).
    #[arg(
        long,
        env = "GPULEDGER_SCHEDULER_NAMES",
        value_delimiter = ',',
        default_value = "gpuledger-scheduler,default-scheduler"
    )]
    pub scheduler_names: Vec<String>,

    /// What one caller may write (node agents' write rate, inventory size).
    #[command(flatten)]
    pub write_limits: crate::write_limits::WriteLimitArgs,

    /// The longest a token's verdict is cached, in seconds (never past the token's expiry).
    #[arg(long, env = "GPULEDGER_TOKEN_CACHE_MAX_S", default_value_t = 300)]
    pub token_cache_max_s: u64,

    /// Bounds on what callers may hold of this replica.
    #[command(flatten)]
    pub limits: Limits,

    /// Per-namespace series on /metrics (`*_namespace_*`: GPU held, quotas, budgets). Off by
    /// default: they name every tenant's namespace and its usage, and that port has no
    /// authentication; turn it on where only Prometheus reaches the port (a NetworkPolicy).
    #[arg(long, env = "GPULEDGER_METRICS_NAMESPACES")]
    pub metrics_namespaces: bool,

    /// Log format: "human" or "json".
    #[arg(long, env = "GPULEDGER_LOG_FORMAT", default_value = "human", value_parser = ["human", "json"])]
    pub log_format: String,
}

impl Config {
    /// The advertised address.
    pub fn advertise(&self) -> String {
        self.advertise.clone().unwrap_or_else(|| {
            let mut a = self.listen;
            if a.ip().is_unspecified() {
                a.set_ip([127, 0, 0, 1].into());
            }
            a.to_string()
        })
    }

    /// The replica name.
    pub fn replica(&self) -> String {
        self.replica.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "allocator".into());
            format!("{host}:{}", self.listen.port())
        })
    }

    /// Lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl.max(1))
    }
}

/// What one caller may hold of a replica: connections and TLS handshakes (per peer address),
/// streams and requests (per connection and per verified identity), reviews of tokens the API
/// server refuses, and the threads heavy reads may take. Each refusal is counted in
/// `gpuledger_allocator_limited_total{limit}`.
#[derive(clap::Args, Debug, Clone)]
pub struct Limits {
    /// Open gRPC connections at once (handshakes included); over it a new connection is closed
    /// at once.
    #[arg(long, env = "GPULEDGER_MAX_CONNECTIONS", default_value_t = 16_384)]
    pub max_connections: usize,

    /// Open gRPC connections at once from one peer address.
    #[arg(
        long,
        env = "GPULEDGER_MAX_CONNECTIONS_PER_PEER",
        default_value_t = 256
    )]
    pub max_connections_per_peer: usize,

    /// TLS handshakes in progress at once.
    #[arg(long, env = "GPULEDGER_MAX_TLS_HANDSHAKES", default_value_t = 1024)]
    pub max_tls_handshakes: usize,

    /// TLS handshakes in progress at once from one peer address.
    #[arg(
        long,
        env = "GPULEDGER_MAX_TLS_HANDSHAKES_PER_PEER",
        default_value_t = 64
    )]
    pub max_tls_handshakes_per_peer: usize,

    /// A connection that sends no ClientHello within this many milliseconds is cut; so is a
    /// handshake that takes longer while more than half of the handshake slots are taken.
    #[arg(long, env = "GPULEDGER_TLS_HELLO_TIMEOUT_MS", default_value_t = 1000)]
    pub tls_hello_timeout_ms: u64,

    /// Concurrent gRPC streams on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; a
    /// client queues calls past it).
    #[arg(
        long,
        env = "GPULEDGER_MAX_STREAMS_PER_CONNECTION",
        default_value_t = 256
    )]
    pub max_streams_per_connection: u32,

    /// Open Subscribe, Replicate, ReadLog and ReadSnapshots streams of one verified identity
    /// (a node agent of one node, one certificate, one ServiceAccount); past it
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "GPULEDGER_MAX_STREAMS_PER_IDENTITY", default_value_t = 64)]
    pub max_streams_per_identity: usize,

    /// How long a request's message may take to arrive after its headers, in milliseconds;
    /// past it DEADLINE_EXCEEDED. A request holds no slot in flight until its message has
    /// arrived (0 = no bound).
    #[arg(
        long,
        env = "GPULEDGER_REQUEST_BODY_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub request_body_timeout_ms: u64,

    /// Requests being answered at once per holder of a verified identity (the pod of a
    /// pod-bound token, else the token; the client certificate); past it RESOURCE_EXHAUSTED.
    #[arg(
        long,
        env = "GPULEDGER_MAX_IN_FLIGHT_PER_IDENTITY",
        default_value_t = 256
    )]
    pub max_in_flight_per_identity: usize,

    /// A connection that carried a call refused for being over a limit (RESOURCE_EXHAUSTED:
    /// requests in flight, streams, heavy reads, a node's write budget) is not read for this
    /// many milliseconds, so that a flood of refused calls waits in its sender's socket instead
    /// of costing a refusal each; answers and streams already open still flow. Allocators
    /// (which forward others' calls) and the extender (scheduling itself) are never paused
    /// (0 = off).
    #[arg(long, env = "GPULEDGER_OVER_LIMIT_PAUSE_MS", default_value_t = 500)]
    pub over_limit_pause_ms: u64,

    /// Heavy reads (Filter, Score, Dump, ReadLog, ReadSnapshots) one verified identity may
    /// start per second, sustained; allocators and the extender, whose reads are part of
    /// scheduling, are not held to it. A read past the rate waits up to a second for its turn,
    /// then is refused with RESOURCE_EXHAUSTED (0 = no limit).
    #[arg(
        long,
        env = "GPULEDGER_HEAVY_READS_PER_IDENTITY_PER_S",
        default_value_t = 20
    )]
    pub heavy_reads_per_identity_per_s: u32,

    /// How many heavy reads one identity may start at once before
    /// --heavy-reads-per-identity-per-s applies.
    #[arg(long, env = "GPULEDGER_HEAVY_READ_BURST", default_value_t = 100)]
    pub heavy_read_burst: u32,

    /// HTTP/2 keep-alive: a ping every this many milliseconds, and a connection whose peer
    /// does not answer within half of it is closed with its streams (0 = off).
    #[arg(long, env = "GPULEDGER_KEEPALIVE_MS", default_value_t = 20_000)]
    pub keepalive_ms: u64,

    /// Tokens the API server refused, per peer address and minute, before new tokens from that
    /// address are no longer reviewed (RESOURCE_EXHAUSTED) until the minute passes; a token
    /// that is not a JWT for audience gpuledger is refused without a review (0 = no bound).
    #[arg(
        long,
        env = "GPULEDGER_MAX_FAILED_TOKEN_REVIEWS_PER_PEER",
        default_value_t = 30
    )]
    pub max_failed_token_reviews_per_peer: u64,

    /// ReadLog scans of the history that run at once (those of allocators and the extender
    /// not counted); past it RESOURCE_EXHAUSTED (0 = no bound).
    #[arg(long, env = "GPULEDGER_MAX_LOG_SCANS", default_value_t = 8)]
    pub max_log_scans: usize,

    /// ReadLog scans that one holder of an identity (a token, a pod, a certificate) runs at
    /// once, so that one viewer cannot take every scan slot from the other operators; past
    /// it RESOURCE_EXHAUSTED (0 = no bound).
    #[arg(long, env = "GPULEDGER_MAX_LOG_SCANS_PER_HOLDER", default_value_t = 2)]
    pub max_log_scans_per_holder: usize,

    /// Events a second that one holder of an identity's ReadLog scans stream together, pages
    /// from the archive and etcd alike, after a second's worth at once; a page past it waits
    /// for its turn (0 = no bound).
    #[arg(
        long,
        env = "GPULEDGER_LOG_SCAN_EVENTS_PER_S",
        default_value_t = 20_000
    )]
    pub log_scan_events_per_s: u32,

    /// Events a second that every holder's ReadLog scans stream together (allocators' and the
    /// extender's not counted), after a second's worth at once: many holders' scans cost the
    /// leader what one holder's do (0 = no bound).
    #[arg(
        long,
        env = "GPULEDGER_LOG_SCAN_EVENTS_TOTAL_PER_S",
        default_value_t = 20_000
    )]
    pub log_scan_events_total_per_s: u32,

    /// Threads that answer CPU-heavy reads (Filter, Score, Dump, ReadLog pages) off the async
    /// runtime, which keeps the leader's lease alive; further heavy reads wait for one.
    #[arg(long, env = "GPULEDGER_HEAVY_READ_THREADS", default_value_t = 2)]
    pub heavy_read_threads: usize,
}

fn parse_policy(s: &str) -> Result<gpuledger_ledger::Policy, String> {
    s.parse()
}

/// TLS to etcd: the CA to trust and, for client-certificate auth, our certificate and key.
#[derive(Debug, Clone, Default)]
pub struct EtcdTls {
    /// CA bundle (PEM).
    pub ca: Option<std::path::PathBuf>,
    /// Client certificate and key (PEM).
    pub identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
}

impl Config {
    /// The etcd TLS settings, None for plain-text etcd.
    pub fn etcd_tls(&self) -> Option<EtcdTls> {
        let identity = self.etcd_cert.clone().zip(self.etcd_key.clone());
        (self.etcd_ca.is_some() || identity.is_some()).then(|| EtcdTls {
            ca: self.etcd_ca.clone(),
            identity,
        })
    }
}
