//! Who may call gpuledger, and how a caller proves it.
//!
//! Every listener speaks TLS whose certificates reload when their files change ([`tls`]).
//! Every call to the allocator carries an identity that is verified before anything is read or
//! written: a ServiceAccount token reviewed by the API server ([`token`]) or a client
//! certificate whose URI SAN names a gpuledger role ([`identity`]), checked in one tower layer
//! ([`server`]). What each role may then do is one table ([`rules`]). Clients get all of this
//! from [`client::Credentials`].

pub mod args;
pub mod client;
pub mod https;
pub mod identity;
pub mod limit;
#[cfg(feature = "pki")]
pub mod pki;
pub mod rules;
pub mod server;
pub mod tls;
pub mod token;

pub use args::{PlainHttpArgs, ServerTlsArgs};
pub use client::{AuthChannel, CredentialArgs, Credentials, endpoint};
pub use identity::{Caller, Role};
pub use rules::{Call, Denied, Facts, PodFacts, authorize};
pub use server::{AuthLayer, Authenticated, Authenticator, CallerLimits, Refusal};
