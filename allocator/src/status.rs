//! How the shells' refusals read to a gRPC caller: the one place a domain error of the
//! watchers' checks becomes a `tonic::Status`, so the checks themselves speak their own words.

use tonic::Status;

use crate::budget_watch::Refusal;

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
