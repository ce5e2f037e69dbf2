//! How the shells' refusals read to a gRPC caller: the one place a write's error and a domain
//! error of the watchers' checks become a `tonic::Status`, so the sequencer and the checks
//! speak their own words.

use gpuledger_ledger::CommandError;
use tonic::Status;

use crate::budget_watch::Refusal;
use crate::writer::WriteError;

/// A write that was not committed, as the caller is told: a refusal by the ledger by its kind,
/// and a write without an answer as UNAVAILABLE (retry).
impl From<WriteError> for Status {
    fn from(e: WriteError) -> Status {
        match e {
            WriteError::Refused(e) => match e {
                CommandError::Invalid(m) => Status::invalid_argument(m),
                CommandError::NotFound(m) => Status::not_found(m),
                CommandError::NoCapacity(m) => Status::resource_exhausted(m),
                CommandError::Unsatisfiable(m) => Status::failed_precondition(m),
                CommandError::Conflict(m) => Status::already_exists(m),
                CommandError::Bug(m) => Status::internal(m.to_string()),
            },
            e @ WriteError::InvalidEvent(_) => Status::internal(e.to_string()),
            e @ (WriteError::NotLeader | WriteError::Unavailable(_)) => {
                Status::unavailable(e.to_string())
            }
        }
    }
}

/// A budget or quota change that a GPUBudget owns, or a demote budget whose priority class is
/// missing, is FAILED_PRECONDITION (fix the cluster, then retry); an API server that could not
/// answer is UNAVAILABLE (retry).
impl From<Refusal> for Status {
    fn from(e: Refusal) -> Status {
        match e {
            e @ (Refusal::Governed { .. } | Refusal::NoPriorityClass(_)) => {
                Status::failed_precondition(e.to_string())
            }
            e @ Refusal::Unchecked { .. } => Status::unavailable(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    #[test]
    fn a_governed_change_is_a_failed_precondition_that_names_the_object() {
        let s = Status::from(Refusal::Governed {
            what: "quota",
            namespace: String::new(),
            by: "gpuledger-system/default".into(),
        });
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert_eq!(
            s.message(),
            "the quota of the cluster default is set by GPUBudget gpuledger-system/default: \
             change or delete that object (kubectl edit gpubudget -n gpuledger-system)"
        );
        let s = Status::from(Refusal::NoPriorityClass("low".into()));
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.message().contains("\"low\" does not exist"), "{s}");
    }
}
