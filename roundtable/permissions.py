"""Who may ask for what: write-policy ceilings, separation of duties, tenants.

The server decides these, never the requester. Every rule here is checked
where the person is authenticated (the API, the CLI) *and* again by the worker,
because a run or a decision can also arrive straight through Temporal, where
nobody's role is known: such a run is held to the service ceiling, and such a
decision counts as made by nobody in particular (see :func:`attest`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from roundtable.config import Settings
from roundtable.models import (
    Attestation,
    Decision,
    ExtendInput,
    ReconcileInput,
    RunInput,
)
from roundtable.security import derive_subkey, read_action_secret
from roundtable.store.errors import ForbiddenError, InvalidInputError
from roundtable.tools.policy import AUTO_APPROVE_PREFIX, RISK_ORDER

# From least to most a requester can ask for.
_POLICY_ORDER = (
    "deny_writes",
    "confirm_all_writes",
    *(AUTO_APPROVE_PREFIX + risk for risk in RISK_ORDER),
)


class PolicyNotAllowedError(ForbiddenError):
    code = "policy_not_allowed"


class OperatorRequiredError(ForbiddenError):
    code = "operator_required"


class SelfApprovalError(ForbiddenError):
    code = "self_approval_not_allowed"


class TenantNotAllowedError(ForbiddenError):
    code = "tenant_not_allowed"


class AttestationExpiredError(ForbiddenError):
    code = "attestation_expired"


class ModelNotAllowedError(InvalidInputError):
    code = "model_not_allowed"


def policy_rank(policy: str) -> int:
    try:
        return _POLICY_ORDER.index(policy)
    except ValueError:
        raise InvalidInputError(f"unknown write policy {policy!r}") from None


def capped_policy(requested: str, ceiling: str) -> str:
    """The requested policy, or the ceiling when it asks for more."""
    return requested if policy_rank(requested) <= policy_rank(ceiling) else ceiling


@dataclass(frozen=True)
class Decider:
    """Who decides, as the API or CLI authenticated them. ``role`` None: a
    decision that reached the workflow without the server's attestation (a raw
    signal or update), whose ``decided_by`` nobody vouched for."""

    user_id: str
    role: str | None
    tenants: tuple[str, ...] | None = None  # None: every tenant


@dataclass(frozen=True)
class Authority:
    """The server's rules, read from its settings."""

    ceilings: Mapping[str, str]
    approvers: str
    operator_risk: str
    allowed_models: frozenset[str]
    default_model: str | None = None
    # How long an approval may be kept open: per extension, how many, in all.
    max_extension_seconds: int = 7 * 24 * 3600
    max_extensions: int = 3
    max_total_seconds: int = 7 * 24 * 3600
    # The lease and heartbeat of a run that sets none (README, "Worker
    # tuning"); a field missing here keeps RunInput's own default.
    run_defaults: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Settings) -> Authority:
        ceilings = {
            "user": settings.policy_ceiling_user,
            "service": settings.policy_ceiling_service,
            "operator": settings.policy_ceiling_operator,
        }
        for role, policy in ceilings.items():
            if policy not in _POLICY_ORDER:
                raise ValueError(
                    f"ROUNDTABLE_POLICY_CEILING_{role.upper()}={policy!r} is not a write policy"
                )
        models = set(settings.allowed_models) or {"scripted"}
        if not settings.allowed_models and settings.default_model:
            models.add(settings.default_model)
        return cls(
            ceilings=ceilings,
            approvers=settings.approvers,
            operator_risk=settings.operator_approval_risk,
            allowed_models=frozenset(models),
            default_model=settings.default_model,
            max_extension_seconds=settings.max_approval_extension_seconds,
            max_extensions=settings.max_approval_extensions,
            max_total_seconds=settings.max_approval_total_seconds,
            run_defaults={
                name: value
                for name, value in (
                    ("lease_seconds", settings.run_lease_seconds),
                    ("heartbeat_timeout_seconds", settings.run_heartbeat_timeout_seconds),
                )
                if value is not None
            },
        )

    def ceiling(self, role: str | None) -> str:
        """What a role may ask for; anyone unknown gets the service ceiling."""
        return self.ceilings.get(role or "service", self.ceilings["service"])

    def check_policy(self, role: str | None, policy: str) -> None:
        ceiling = self.ceiling(role)
        if policy_rank(policy) > policy_rank(ceiling):
            raise PolicyNotAllowedError(
                f"write_policy {policy!r} is more than a {role or 'service'} may ask for "
                f"(at most {ceiling!r})"
            )

    def granted_policy(
        self, run: Mapping[str, Any], requested: str, fingerprint: str | None = None
    ) -> str:
        """The policy the worker lets a run use: what the API or CLI granted
        for exactly this request (same policy; with ``fingerprint``, the same
        request in every field), else no more than the service ceiling."""
        granted = run.get("granted_write_policy") == requested and run.get("started_by_role")
        if fingerprint is not None and run.get("request_fingerprint") != fingerprint:
            granted = False
        if granted:
            return capped_policy(requested, self.ceiling(run["started_by_role"]))
        return capped_policy(requested, self.ceiling("service"))

    def admit(self, role: str, request: RunInput) -> RunInput:
        """The request as this role may make it (the server's default model,
        lease and heartbeat where it names none), or PolicyNotAllowedError /
        ModelNotAllowedError / InvalidInputError."""
        if self.default_model and "model" not in request.model_fields_set:
            request = request.model_copy(update={"model": self.default_model})
        unset = {k: v for k, v in self.run_defaults.items() if k not in request.model_fields_set}
        if unset:
            request = request.model_copy(update=unset)
            if request.heartbeat_timeout_seconds >= request.lease_seconds:
                raise InvalidInputError(
                    f"heartbeat_timeout_seconds ({request.heartbeat_timeout_seconds}) must be "
                    f"shorter than lease_seconds ({request.lease_seconds})"
                )
        self.check_policy(role, request.write_policy)
        self.check_models(request.models())
        return request

    def check_models(self, models: Iterable[str]) -> None:
        if "*" in self.allowed_models:  # ROUNDTABLE_ALLOWED_MODELS='["*"]': any model
            return
        refused = sorted({m for m in models if m not in self.allowed_models})
        if refused:
            raise ModelNotAllowedError(
                f"model {refused[0]!r} is not allowed here; allowed: "
                + ", ".join(sorted(self.allowed_models))
            )

    def check_decider(self, decider: Decider, run_owner: str, risk_level: str) -> None:
        """Separation of duties: may this person decide this write?"""
        needs_operator = self.operator_risk in RISK_ORDER and (
            RISK_ORDER.index(risk_level) >= RISK_ORDER.index(self.operator_risk)
        )
        if needs_operator and decider.role != "operator":
            raise OperatorRequiredError(
                f"writes at {self.operator_risk} or above are decided by an operator "
                "(through the API or CLI)"
            )
        if self.approvers == "others" and decider.role is None:
            raise SelfApprovalError(
                "with ROUNDTABLE_APPROVERS=others, decisions come through the API or CLI, "
                "where the decider is known"
            )
        if self.approvers == "others" and decider.user_id == run_owner:
            raise SelfApprovalError(
                "the person who started a run may not approve its writes "
                "(ROUNDTABLE_APPROVERS=others)"
            )


def check_tenant(tenants: Iterable[str] | None, tenant: Any, whom: str) -> None:
    """Refuse a write naming a tenant outside ``tenants`` (None: any tenant)."""
    if tenants is None:
        return
    allowed = set(tenants)
    if not isinstance(tenant, str) or tenant not in allowed:
        raise TenantNotAllowedError(f"{whom} may not act for tenant {tenant!r}")


# ------------------------------------------------------------------ attestation

_ATTEST_LABEL = b"roundtable/decision-attestation/v2"
# An attestation is good for this long: a message copied out of a history
# later (every history is readable through the UI) vouches for nobody.
MAX_ATTESTATION_AGE = timedelta(minutes=10)
Attestable = TypeVar("Attestable", Decision, ReconcileInput, ExtendInput)


def _mac(fields: Mapping[str, Any], role: str, tenants: list[str] | None, at: datetime) -> str:
    material = json.dumps(
        {**fields, "role": role, "tenants": tenants, "at": at.isoformat()},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    key = derive_subkey(read_action_secret(), _ATTEST_LABEL)
    return hmac.new(key, material, hashlib.sha256).hexdigest()


def attest(message: Attestable, decider: Decider, now: datetime) -> Attestable:
    """The message as sent by ``decider``, with the server's word for it.
    Only the API, the CLI and what else holds the action secret can make one."""
    message = message.model_copy(update={message.subject_field: decider.user_id})
    tenants = list(decider.tenants) if decider.tenants is not None else None
    role = decider.role or "service"
    mac = _mac(message.attested_fields(), role, tenants, now)
    stamp = Attestation(role=role, tenants=tenants, at=now, mac=mac)
    return message.model_copy(update={"attested_by": stamp})


def verified_decider(message: Decision | ReconcileInput | ExtendInput, now: datetime) -> Decider:
    """Who sent it, as attested; without a valid attestation, nobody vouched
    for the name it carries (role None). One too old is refused
    (AttestationExpiredError): what it limited would go unchecked."""
    stamp = message.attested_by
    # A time without a zone cannot be compared (and no server writes one):
    # taken as no attestation (decider_whatever_its_age), never an error
    # the decision retries on.
    if (
        stamp is not None
        and stamp.at.tzinfo is not None
        and (abs(now - stamp.at) > MAX_ATTESTATION_AGE)
    ):
        # Refused, not taken as nobody's: whatever the attestation limited
        # (tenants, say) would no longer be checked. A decision that waited
        # this long (no worker took it) is made again.
        raise AttestationExpiredError(
            f"the server's word on who sent this is older than {MAX_ATTESTATION_AGE}: send it again"
        )
    return decider_whatever_its_age(message)


def decider_whatever_its_age(message: Decision | ReconcileInput | ExtendInput) -> Decider:
    """Who sent it, as attested, however old the attestation: only to find
    a request's own record (a change its earlier attempt made), never to
    make a change (verified_decider)."""
    stamp = message.attested_by
    subject = getattr(message, message.subject_field)
    nobody = Decider(user_id=subject, role=None)
    if stamp is None or stamp.at.tzinfo is None:
        return nobody
    expected = _mac(message.attested_fields(), stamp.role, stamp.tenants, stamp.at)
    if not hmac.compare_digest(expected, stamp.mac):
        return nobody
    tenants = tuple(stamp.tenants) if stamp.tenants is not None else None
    return Decider(user_id=subject, role=stamp.role, tenants=tenants)


def check_reconciler(decider: Decider) -> None:
    if decider.role != "operator":
        raise OperatorRequiredError(
            "reconciling is for operators: through the API, the CLI, or a typed client "
            "that holds the action secret"
        )
